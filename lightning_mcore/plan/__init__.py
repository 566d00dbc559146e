"""`lightning-mcore plan`: the per-GPU memory of a training config, from the config alone."""
