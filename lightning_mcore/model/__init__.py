"""The GPT model: its settings (`config`), how mcore's GPTModel is built from them (`build`,
`init`), its FLOPs (`flops`) and the layer variants the families need (attention, MLA, norms, RoPE
variants, gated DeltaNet, torch's grouped experts, fp32 logits, the vision encoder's hooks). Also
the layer-level seams generation drives from inside the layers (`inference_context`,
`generation_dispatcher`, `routing_replay`): they are imported by the layers, so they live here
and the model imports neither generation nor LoRA."""
