"""LoRA over an FP8 frozen base (LoRAConfig.base_precision="fp8", lora/quantized_base.py).

The reference everywhere is a plain LoRA model whose base weights are the FP8 codes dequantized
by hand here (per output row: s = amax / 448, codes = e4m3(W / s), W' = codes * s in fp32):
  - in one process, its logits and adapter gradients equal the FP8 model's (dense layers and
    torch's grouped experts), and autograd's saved tensors hold no base weight (exactly their
    bytes fewer than the plain model's);
  - on a tiny Qwen2-MoE (attention, dense MLP, shared and routed experts) trained 3 SGD steps at
    TP=1, TP=2, PP=2 and EP=2 (torch's grouped experts): losses, logits and adapters equal the
    reference run on the dequantized HF checkpoint; the reported quantization error is the
    hand-computed one; the peft export loads in peft on the dequantized base and the merged
    export equals peft's merge_and_unload there; both say the base was fp8;
  - a run saved at TP=2 and resumed at TP=1 continues as an uninterrupted TP=1 run.
"""

import gc
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import hf_logits, make_hf_model
from lightning_mcore import OptimizerSettings
from lightning_mcore.export_checkpoint import single_process_megatron
from lightning_mcore.lora.adapters import apply_lora
from lightning_mcore.lora.config import LoRAConfig, LoRAError
from lightning_mcore.model.build import build_chunks
from lightning_mcore.model.config import to_transformer_config
from lightning_mcore.strategy.parallel import ParallelConfig
from readme import commands, run, section, user_dir
from test_lora import TOKENS, Probe, peft_and_merged_match
from test_lora_experts_resume import adapters as saved_adapters
from test_lora_experts_resume import run as run_with_checkpoints
from toy import TokenRows, assemble, fit, tiny_config

LORA = LoRAConfig(target_modules="all-linear", rank=8, alpha=16.0)
FP8 = LoRAConfig(target_modules="all-linear", rank=8, alpha=16.0, base_precision="fp8")
SGD = OptimizerSettings(lr=0.5, optimizer="sgd", weight_decay=0.0, warmup_steps=0)
TORCH_EXPERTS = {"moe_grouped_gemm": True, "moe_grouped_gemm_backend": "torch"}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of an element (normal
# codes; the subnormal ones, below amax / 2^15 in a row, err by at most 2^-10 of the scale).
E4M3_BOUND = 2.0 ** -4


def by_hand(w: torch.Tensor) -> torch.Tensor:
    """W' = e4m3(W / s) * s, s = amax(|row|) / 448, in fp32."""
    scale = w.float().abs().amax(dim=-1, keepdim=True) / 448.0
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def dequantized_copy(source: Path, dest: Path, hand=by_hand) -> dict:
    """`source` with its adapted weights replaced by W' = hand(W) (config and tokenizer-less files
    copied); returns {kind: relative Frobenius error} as our report names the kinds."""
    dest.mkdir()
    tensors, sums = load_file(source / "model.safetensors"), {}
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] in ADAPTED and name.endswith(".weight"):
            tensors[name] = hand(w)
            sums.setdefault(kind_of(name), []).append((w, tensors[name]))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    for f in source.glob("*.json"):
        (dest / f.name).write_text(f.read_text())
    return {k: math.sqrt(sum(float((w - q).square().sum()) for w, q in pairs)
                         / sum(float(w.square().sum()) for w, _ in pairs)) for k, pairs in sums.items()}


def kind_of(hf_name: str) -> str:
    proj = hf_name.rsplit(".", 2)[-2]
    mcore = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
             "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}[proj]
    routed = ".experts." in hf_name
    return f"experts.{mcore}" if routed else mcore


# ---------------------------------------------------------------- one process
def _chunk(cfg, dtype):
    torch.manual_seed(0)
    tf_config = to_transformer_config(cfg, ParallelConfig(), dtype, on_cpu=True, use_te=False)
    (chunk,) = build_chunks(cfg, tf_config, use_te=False)
    return chunk


def _saved_during(chunk, tokens):
    """Loss and every tensor autograd saved for the backward: (shape, dtype, bytes)."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunk(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None,
                     labels=tokens.roll(-1, 1)).sum()
    return loss, saved


def _adapted_weights(chunk) -> list:
    from lightning_mcore.lora.adapters import _base_module, _split, adapters_of

    out = []
    for name, adapter, model in adapters_of([chunk]):
        layer, _ = _split(name)
        out += [getattr(_base_module(model, layer, path), w) for path, w in adapter.bases]
    return out


EXPERTS = dict(num_moe_experts=4, moe_ffn_hidden_size=64, **TORCH_EXPERTS)  # 64: whole NF4 blocks


@pytest.mark.parametrize("experts", [{}, EXPERTS], ids=["dense", "torch_experts"])
def test_fp8_base_computes_with_the_codes_and_saves_no_weight(experts):
    computes_with_the_codes_and_saves_no_weight(experts, "fp8", by_hand)


def computes_with_the_codes_and_saves_no_weight(experts: dict, precision: str, hand) -> None:
    """A `precision` base's loss and adapter gradients equal a bf16 model's whose base is `hand`'s
    dequantized weights, bit for bit; autograd saves no base weight."""
    cfg = tiny_config(num_layers=2, **experts)
    tokens = torch.randint(0, 500, (1, 5), generator=torch.Generator().manual_seed(1))
    got = {}
    with single_process_megatron():
        for base in (precision, "bf16"):
            chunk = _chunk(cfg, torch.bfloat16)
            apply_lora([chunk], LORA, seed=0)
            weights = _adapted_weights(chunk)
            with torch.no_grad():
                for w in weights:  # the reference: W' by hand; the quantized model: W (quantized below)
                    w.copy_(hand(w).to(w.dtype) if base == "bf16" else w)
                for adapter in chunk.lora.values():  # B != 0: A's gradient too
                    adapter.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
            shapes = {(tuple(w.shape), w.dtype) for w in weights}
            # frozen torch experts reach autograd as one [E, out, in] view of their weights (model/torch_experts.py)
            shapes |= {((len(m.local_experts), *getattr(m.local_experts[0], n).weight.shape), torch.bfloat16)
                       for m in chunk.modules() if hasattr(m, "base_gemms") for n in ("linear_fc1", "linear_fc2")}
            weight_bytes = sum(w.numel() * w.element_size() for w in weights)
            if base == precision:
                from lightning_mcore.lora.adapters import quantize_bases
                from lightning_mcore.lora.quantized_base import CODECS

                quantize_bases([chunk], CODECS[precision])
                assert all(w.stride() == (0, 0) for w in weights)  # no memory between calls
                materialised = []  # torch's grouped experts compute from the codes (lora/grouped_base.py)
                for m in chunk.modules():
                    if getattr(m, "base_gemms", None):
                        m.register_forward_pre_hook(lambda m, _: materialised.append(any(
                            e.linear_fc1.weight.stride() != (0, 0) or e.linear_fc2.weight.stride() != (0, 0)
                            for e in m.local_experts)))
            loss, saved = _saved_during(chunk, tokens)
            if base == precision:
                assert len(materialised) == (cfg.num_layers if experts else 0) and not any(materialised)
            loss.backward()
            grads = {n: p.grad.float().clone() for n, p in chunk.named_parameters() if p.requires_grad}
            got[base] = (loss.detach().float(), grads, saved, weight_bytes, shapes)
    (loss8, grads8, saved8, _, shapes), (loss, grads, saved, weight_bytes, _) = got[precision], got["bf16"]
    assert grads8.keys() == grads.keys() and all(k.startswith("lora.") for k in grads)
    torch.testing.assert_close(loss8, loss, rtol=0, atol=0)
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads8[name], g, rtol=0, atol=0, msg=name)
    kept = [b for shape, dtype, b in saved if (shape, dtype) in shapes]
    # the reference keeps every weight on a gradient's path (not the first linear's: its input,
    # the frozen embedding's, needs none), the quantized model none, and nothing else changes
    assert weight_bytes > sum(kept) > weight_bytes / 2, (kept, weight_bytes)
    assert not [s for s in saved8 if (s[0], s[1]) in shapes], "a dequantized weight was saved"
    assert sum(b for *_, b in saved) - sum(b for *_, b in saved8) == sum(kept)


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python's collector tracks, garbage included."""
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter):
            storage = o.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("precision", ["fp8", "nf4", "mxfp4"])
def test_steps_leave_no_dequantized_weight_behind(precision):
    """With the collector's passes off (training defers them: gc.freeze, manual gc), forward and
    backward over a quantized base free every dequantized weight: no tensor bytes more after 3
    steps than after the first. (A call's hooks once formed a reference cycle that kept
    backward's dequantized weight until a full pass: ~25 GiB a step for a Llama-3-8B on GPU.)"""
    cfg = tiny_config(num_layers=2, **EXPERTS)
    tokens = torch.randint(0, 500, (1, 5), generator=torch.Generator().manual_seed(1))
    lora = LoRAConfig(target_modules="all-linear", rank=8, alpha=16.0, base_precision=precision)
    with single_process_megatron():
        chunk = _chunk(cfg, torch.bfloat16)
        apply_lora([chunk], lora, seed=0)

        def step():
            chunk(tokens, torch.arange(5).expand_as(tokens), None, labels=tokens.roll(-1, 1)).sum().backward()

        step()  # the gradients' first allocations
        gc.collect()
        gc.disable()
        try:
            before = _live_tensor_bytes()
            for _ in range(3):
                step()
            after = _live_tensor_bytes()
        finally:
            gc.enable()
    assert after == before, (before, after)


@pytest.mark.parametrize("precision", ["fp8", "nf4", "mxfp4"])
def test_unsupported_base_precisions_are_refused(precision):
    with pytest.raises(LoRAError, match="base_precision 'int4' is not supported: use 'bf16'"):
        LoRAConfig(base_precision="int4")
    from lightning_mcore.lora.checks import LoRAPlanError, check_lora_plan

    lora = LoRAConfig(base_precision=precision)
    refusal = f"base_precision='{precision}' runs on .* transformer_impl='local'"
    with pytest.raises(LoRAPlanError, match=refusal) as info:
        check_lora_plan(lora, tiny_config(), uses_te=True)
    assert info.value.lora == ("base_precision",)
    check_lora_plan(lora, tiny_config(), uses_te=False)


# ---------------------------------------------------------------- across layouts
class Facts(Probe):
    """Probe's exports, logits and facts, and the first logits and reported quantization error."""

    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        first = pl_module.forward_logits(TOKENS)
        if trainer.global_rank == 0:
            torch.save(first, self.out / "first_logits.pt")
            (self.out / "error.json").write_text(json.dumps(getattr(pl_module, "base_quantization_error", {})))


class Logits(Facts):
    """Facts without the exports."""

    def on_train_end(self, trainer, pl_module):
        logits = pl_module.forward_logits(TOKENS)
        if trainer.global_rank == 0:
            torch.save(logits, self.out / "logits.pt")


def train(tmp: Path, name: str, source: Path, lora: LoRAConfig, devices: int = 1, export: bool = False,
          overrides=None, **parallel):
    out = tmp / name
    out.mkdir()
    losses = fit(tmp, devices=devices, steps=3, gbs=4, mbs=1, config=str(source), optim=SGD,
                 dataset=TokenRows(n=12, seq=16, vocab=200), dump_weights=True, name=name,
                 callbacks=((Facts if export else Logits)(out),),
                 module_kwargs={"lora": lora, "model_overrides": overrides}, **parallel)
    adapters = {k: v for k, v in assemble(sorted(tmp.glob(f"{name}.end*.pt"))).items() if k.startswith("lora.")}
    return losses, adapters, out


@pytest.mark.distributed
def test_fp8_base_equals_dequantized_reference_across_layouts(tmp_path):
    hand_errors, relative = equals_dequantized_reference_across_layouts(tmp_path, FP8, by_hand)
    # the quantization error: within e4m3's rounding, and what it does to the base model's logits
    # (the adapters start at B = 0)
    for kind, error in hand_errors.items():
        assert 0 < error < E4M3_BOUND, kind
    print(f"FP8 base: weights' relative error {hand_errors}; the base logits' {relative:.4f}")
    # each residual branch (attention, MLP) runs two quantized linears in series, each within
    # 2^-4; the branches' roundings are independent and add to one residual stream, so they do
    # not add up linearly: 2 * 2^-4 bounds the logits (measured: 0.049)
    assert 0 < relative < 2 * E4M3_BOUND


def equals_dequantized_reference_across_layouts(tmp_path: Path, lora: LoRAConfig, hand, pp2: bool = True,
                                                **sizes):
    """The tiny Qwen2-MoE (config fields `sizes` changed) trained with `lora` at TP=1, TP=2, EP=2
    and PP=2 (if `pp2`) equals the reference run on its copy dequantized by `hand`; every run
    reports the hand-computed error; the TP=2 run's exports match peft on the dequantized base
    and say lora.base_precision. Returns the hand errors by kind and the first logits' relative error
    against the unquantized HF model."""
    source, dequantized = tmp_path / "source", tmp_path / "dequantized"
    hf = make_hf_model("qwen2_moe", source, **sizes)
    hand_errors = dequantized_copy(source, dequantized, hand)
    ref_losses, ref_adapters, ref = train(tmp_path, "ref", dequantized, LORA)
    ref_logits = torch.load(ref / "logits.pt")
    assert ref_losses[0] - ref_losses[-1] > 1e-2, ref_losses
    runs = {"tp1": train(tmp_path, "tp1", source, lora),
            "tp2": train(tmp_path, "tp2", source, lora, 2, export=True, tensor_model_parallel_size=2,
                         sequence_parallel=True),  # MoE at TP=2 needs SP; experts at expert-TP 2
            "ep2": train(tmp_path, "ep2", source, lora, 2, overrides=TORCH_EXPERTS, expert_model_parallel_size=2)}
    if pp2:
        runs["pp2"] = train(tmp_path, "pp2", source, lora, 2, pipeline_model_parallel_size=2)
    for name, (losses, adapters, out) in runs.items():
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        torch.testing.assert_close(torch.load(out / "logits.pt"), ref_logits, rtol=0, atol=1e-5, msg=name)
        assert adapters.keys() == ref_adapters.keys(), name
        for key, value in ref_adapters.items():
            torch.testing.assert_close(adapters[key], value, rtol=0, atol=1e-5, msg=f"{name} {key}")

    reported = json.loads((runs["tp1"][2] / "error.json").read_text())
    assert reported.keys() == hand_errors.keys()
    for kind, error in hand_errors.items():
        assert reported[kind] == pytest.approx(error, rel=1e-4), kind
    for name in ("tp2", "ep2"):
        assert json.loads((runs[name][2] / "error.json").read_text()) == pytest.approx(reported, rel=1e-6), name
    exact = hf_logits(hf, TOKENS)
    first = torch.load(runs["tp1"][2] / "first_logits.pt")

    # exports: peft's adapter on the dequantized base gives our logits; merged = its merge
    out = runs["tp2"][2]
    assert json.loads((out / "facts.json").read_text())["base_unchanged"]
    peft_and_merged_match(dequantized, out, torch.load(out / "logits.pt"))
    for kind in ("peft", "merged"):
        export = json.loads((out / kind / "lightning_mcore_export.json").read_text())
        assert export["lora_base_precision"] == lora.base_precision, kind
    return hand_errors, float((first - exact).norm() / exact.norm())


@pytest.mark.distributed
def test_fp8_run_saved_at_tp2_resumes_exactly_and_at_tp1(tmp_path):
    """The checkpoint holds the adapters (and Adam's moments) only; the base is loaded and
    quantized again at resume. At TP=2 the resumed run repeats the uninterrupted one bit for
    bit; at TP=1 (the codes are the TP=2 run's: the row max over the TP group) it continues
    that run within fp32 rounding (other reduction orders). (An uninterrupted TP=1 run has the
    same losses to 1e-5, its adapters differ by up to ~5e-5: Adam divides by sqrt(v), so
    elements with near-zero gradients amplify the first steps' rounding.)"""
    make_hf_model("qwen2_moe", tmp_path / "source")
    tp2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    straight = run_with_checkpoints(tmp_path, "straight", 1, lora=FP8)
    straight2 = run_with_checkpoints(tmp_path, "straight2", 2, lora=FP8, **tp2)
    saved = tmp_path / "straight2-ckpts" / "epoch=0-step=2.ckpt"
    resumed2 = run_with_checkpoints(tmp_path, "resumed2", 2, ckpt_path=str(saved), lora=FP8, **tp2)
    resumed = run_with_checkpoints(tmp_path, "resumed", 1, ckpt_path=str(saved), lora=FP8)
    assert len(straight) == 4 and straight2 == pytest.approx(straight, rel=1e-5)
    assert resumed2 == straight2[2:], (resumed2, straight2)
    assert resumed == pytest.approx(straight2[2:], rel=1e-6), (resumed, straight2)
    fresh = saved_adapters(tmp_path, "straight", "init", 1)
    for (name, ranks), (ref, tol) in {("resumed2", 2): (("straight2", 2), 0.0),
                                      ("resumed", 1): (("straight2", 2), 1e-6)}.items():
        want, got = saved_adapters(tmp_path, ref[0], "end", ref[1]), saved_adapters(tmp_path, name, "end", ranks)
        assert max((want[k] - fresh[k]).abs().max().item() for k in want) > 1e-2, "nothing trained"
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            torch.testing.assert_close(got[key], tensor, rtol=0, atol=tol, msg=f"{name} {key}")


def test_docs_fp8_config_trains_and_exports_merged(tmp_path):
    """docs/lora.md's commands, verbatim: the FP8 base is reported, the checkpoint holds the
    adapters only, and the export command (which rebuilds and quantizes the base) writes the
    merged model, marked fp8."""
    docs_config_trains_and_exports_merged(tmp_path, section("LoRA over an FP8 base", "lora.md"), "fp8", "sft_lora_fp8")


def docs_config_trains_and_exports_merged(tmp_path: Path, text: str, precision: str, run_name: str) -> None:
    """A docs section's `text`: its fit command reports the `precision` base, its export writes
    runs/`run_name`/merged, marked `precision`."""
    work = user_dir(tmp_path)
    fit_argv, export_argv = commands(text)
    trained = run(fit_argv, work)
    assert f"LoRA base in {precision}" in trained.stdout + trained.stderr
    run(export_argv, work)
    merged = work / "runs" / run_name / "merged"
    assert json.loads((merged / "lightning_mcore_export.json").read_text())["lora_base_precision"] == precision
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))
