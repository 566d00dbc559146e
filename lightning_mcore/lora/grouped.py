"""LoRA on Transformer Engine's grouped-GEMM experts (TEGroupedMLP).

Its linear_fc1 / linear_fc2 each hold every local expert's weight (weight0 .. weight<n-1>) and
run them in one grouped GEMM over the dispatched tokens, which arrive sorted by expert with the
per-expert counts m_splits:

    x [t_0 + t_1 + ... , in]  --split by m_splits-->  x_e [t_e, in]  ->  x_e W_e^T  (one call)

The layer's stacked expert adapter (the same as the SequentialMLP's: names, A/B, checkpoint
keys) adds scale * B_e A_e x_e to expert e's rows, from one forward hook on the grouped linear.
"""

from __future__ import annotations

import torch


def is_grouped_linear(module) -> bool:
    """TE's grouped linear: one module, one weight per local expert."""
    return hasattr(module, "num_gemms") and hasattr(module, "weight0")


def expert_weights(module) -> list[torch.Tensor]:
    """The weight of each expert the linear computes (one for a SequentialMLP expert's)."""
    if is_grouped_linear(module):
        return [getattr(module, f"weight{e}") for e in range(module.num_gemms)]
    return [module.weight]


def grouped_hook(adapter):
    """Forward hook adding each local expert's update (its slice of the stacked `adapter`) to
    its rows of the output."""

    def hook(module, args, kwargs, output):
        out, bias = output if isinstance(output, tuple) else (output, None)
        x = args[0] if args else next(iter(kwargs.values()))
        splits = args[1] if len(args) > 1 else kwargs["m_splits"]
        splits = splits.tolist() if torch.is_tensor(splits) else [int(s) for s in splits]
        if len(splits) != adapter.experts:
            raise RuntimeError(f"grouped linear got {len(splits)} token counts for "
                               f"{adapter.experts} local experts")
        if adapter.enabled and not adapter.merged:
            # unbind once: its backward stacks the experts' gradients in one op (indexing per
            # expert would write a full-size gradient per expert)
            a, b = adapter.lora_A.unbind(0), adapter.lora_B.unbind(0)
            delta = torch.cat([adapter.update(rows, a[e], b[e]).to(out.dtype)
                               for e, rows in enumerate(x.split(splits))])
            out = out + delta
        return (out, bias) if isinstance(output, tuple) else out

    return hook
