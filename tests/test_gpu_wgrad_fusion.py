"""Weight-gradient accumulation fusion (model/build.py: fuse_wgrad_accumulation): TE layers write
their weight gradients into mcore DDP's fp32 main_grad themselves, and the gradients equal
the unfused path's (bf16 weight grad, then DDP adds it to main_grad) up to that bf16 rounding."""

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _main_grads(fuse: bool, cfg, micro):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from lightning_mcore.model.build import build_chunks
    from lightning_mcore.model.config import to_transformer_config
    from lightning_mcore.model.init import init_layout_invariant
    from lightning_mcore.strategy.parallel import ParallelConfig

    tf = to_transformer_config(cfg, ParallelConfig(), torch.bfloat16, on_cpu=False, use_te=True)
    (model,) = build_chunks(cfg, tf, use_te=True, fuse_wgrad=fuse)
    model.cuda()
    init_layout_invariant([model], cfg, seed=7)
    ddp = DistributedDataParallel(config=tf, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    ddp.zero_grad_buffer()
    for tokens in micro:  # two microbatches accumulate into the same buffers
        pos = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
        ddp(input_ids=tokens, position_ids=pos, attention_mask=None, labels=tokens).float().sum().backward()
    te_weights = [p for n, p in ddp.module.named_parameters() if n.startswith("decoder") and p.dim() == 2]
    return ({n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()},
            [p.grad_added_to_main_grad for p in te_weights])


def test_fused_wgrad_equals_unfused():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from lightning_mcore import GPTConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(7)
        cfg = GPTConfig(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                        num_query_groups=2, vocab_size=1000, seq_length=128,
                        transformer_impl="transformer_engine")
        gen = torch.Generator(device="cuda").manual_seed(0)
        micro = [torch.randint(0, 1000, (2, 128), device="cuda", generator=gen) for _ in range(2)]
        fused, fused_flags = _main_grads(True, cfg, micro)
        plain, plain_flags = _main_grads(False, cfg, micro)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    assert fused_flags and all(fused_flags)  # TE wrote these into main_grad itself
    assert not any(plain_flags)  # ... and here DDP's hook added bf16 grads
    assert fused.keys() == plain.keys()
    for name in plain:
        rel = (fused[name] - plain[name]).norm() / plain[name].norm().clamp(min=1e-12)
        assert rel < 1e-2, (name, float(rel))
        assert plain[name].norm() > 0, name
