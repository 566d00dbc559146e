"""Generation from the mcore chunks: batched greedy or sampled decoding (`batched`) over a KV cache
(`kv_cache`), decode steps replayed from CUDA graphs (`decode_graphs`), reproducible decode
attention, the step inputs of a vision-language model (`vision_columns`) and whole-row logits
without a cache (`forward_logits`). The layer-level pieces generation needs inside the model (the
inference-context seam, the generation token dispatcher, routing replay) live in the model
package, so the model never imports generation."""
