"""LoRA: the settings (`config`), the adapters hooked onto mcore's linears and experts
(`adapters`, `grouped` for Transformer Engine's grouped experts) and the checks that refuse a plan
that cannot work before any model is built (`checks`). Built on the model package, never the other
way round."""
