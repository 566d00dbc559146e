"""benchmarks/hf_baseline.py, the HF side of the throughput comparison: its accumulated step equals
one full-batch step in transformers' plainest code, compiled attention runs without a mask, and the
bench shapes map to transformers models of the right size."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hb = _load("hf_baseline")


@pytest.mark.parametrize("name", sorted(hb.SELFTEST_SHAPES))
def test_accumulated_step_matches_full_batch(name):
    # loss inside the model over 3 micro batches (num_items_in_batch = the global batch's tokens),
    # against eager attention / eager experts over the whole batch with the loss by hand
    hb.selftest_shape(name, hb.SELFTEST_SHAPES[name])


def test_compiled_attention_gets_no_mask():
    """Stock "sdpa" gets a [batch, 1, seq, seq] mask under torch.compile, which rules out the flash
    kernel; the registered causal SDPA gets none and still matches eager attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shape = {**hb.SELFTEST_SHAPES["llama"], "num_layers": 1}
    model = hb.build_model(shape, 16, "fp32", "cpu")
    ref = hb.build_model(shape, 16, "fp32", "cpu", attn="eager")
    masks = []

    def probe(module, q, k, v, attention_mask, **kw):
        masks.append(attention_mask)
        return sdpa_attention_forward(module, q, k, v, attention_mask, **kw)

    AttentionInterface.register(hb.ATTN, probe)
    try:
        x = torch.randint(0, shape["vocab_size"], (2, 16))
        pos = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            got = hb.compile_model(model)(input_ids=x, position_ids=pos).logits
            want = ref(input_ids=x, position_ids=pos).logits
    finally:
        hb.register_causal_sdpa()
        torch._dynamo.reset()
    assert masks == [None]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bench_shapes_build_models_of_their_size():
    """Every bench_pretrain shape builds (on the meta device) a model with the parameter count
    written out from the shape by hand."""
    sys.path.insert(0, str(BENCH))  # bench_pretrain's own imports
    try:
        shapes = _load("bench_pretrain").SHAPES
    finally:
        sys.path.remove(str(BENCH))
    for name, s in shapes.items():
        unknown = sorted(set(s) - hb._MAPPED - hb._MCORE_ONLY)
        if unknown:  # no HF baseline for the hybrids and the 2026 MoE shapes yet: refused by name
            with pytest.raises(ValueError, match=unknown[0]):
                hb.build_model(s, 4096, "bf16", "meta")
            continue
        h, L, V = s["hidden_size"], s["num_layers"], s["vocab_size"]
        hd = s.get("kv_channels") or h // s["num_attention_heads"]
        q, kv = s["num_attention_heads"] * hd, s["num_query_groups"] * hd
        attn = h * (q + 2 * kv) + q * h + 2 * h + (2 * hd if s.get("qk_layernorm") else 0)
        E = s.get("num_moe_experts")
        mlp = E * (3 * h * s["moe_ffn_hidden_size"] + h) if E else 3 * h * s["ffn_hidden_size"]
        model = hb.build_model(s, 4096, "bf16", "meta")
        assert sum(p.numel() for p in model.parameters()) == L * (attn + mlp) + 2 * V * h + h, name
        assert type(model).__name__ == ("Qwen3MoeForCausalLM" if E else "LlamaForCausalLM"), name


@pytest.mark.parametrize("extra", [{"moe_shared_expert_intermediate_size": 64}, {"num_moe_experts": 4,
                                   "moe_router_topk": 2, "moe_ffn_hidden_size": 32}])
def test_refuses_what_it_cannot_map(extra):
    # a key without a transformers equivalent; an MoE shape without QK-norm (Qwen3-MoE has it)
    with pytest.raises(ValueError):
        hb.hf_config({**hb.SELFTEST_SHAPES["llama"], **extra}, 32)
