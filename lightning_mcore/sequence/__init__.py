"""Sequences as the model's forward pass sees them: THD packing of variable-length rows
(`packing`), their slicing over context-parallel ranks (`cp_partition`) and the sums and
broadcasts of per-row results over those ranks (`cp_reduce`). Depends on no other package of
lightning_mcore: the model's attention masks and the objectives both build on it."""
