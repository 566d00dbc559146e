"""Acceptance (HF interop): mcore logits equal transformers' at TP=1, TP=2, PP=2 (EP=2 for MoE);
the export loads in transformers with no missing/unexpected keys and every tensor bit-identical.
"""

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import hf_logits, make_hf_model
from lightning_mcore import MegatronStrategy, PretrainModule

LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2_tp2": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                        sequence_parallel=True, expert_tensor_parallel_size=1)),
}
# The layouts each newer family's parity test runs at (tests/test_family_<name>.py).
FAMILY_LAYOUTS = {
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "dp2": (2, {}),
}
CASES = [(f, lay) for f in ("llama", "llama_tied", "qwen2", "qwen3", "mistral")
         for lay in ("tp1", "tp2", "pp2")] + [("qwen3_moe", "tp1"), ("qwen3_moe", "ep2")]
CASES += [(f, lay) for f in ("mixtral", "qwen2_moe") for lay in ("tp1", "tp2_sp", "pp2", "ep2", "ep2_tp2")]
CASES += [("qwen2_moe_step", "tp1"), ("qwen2_moe_step", "pp2"), ("seed_oss", "tp1"), ("seed_oss", "tp2")]


class SaveLogitsAndExport(L.Callback):
    def __init__(self, out: Path, max_shard_bytes: int = 5 * 2**30) -> None:
        self.out, self.max_shard_bytes = out, max_shard_bytes

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == 0:
            torch.save(outputs, self.out / "logits.pt")

    def on_predict_end(self, trainer, pl_module):
        pl_module.save_hf_checkpoint(self.out / "export", max_shard_bytes=self.max_shard_bytes)


def tensors(directory: Path) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def check_logits_and_export(family: str, layout: str, tmp_path, seq: int = 24,
                            layouts: dict = LAYOUTS, prepare=None, reload: bool = True,
                            **module_kwargs) -> None:
    """Our logits of a tiny `family` model at `layout` equal transformers' within 1e-4; the
    export is bit-identical and transformers reloads it with no missing/unexpected keys.
    `prepare(source)` may change the saved checkpoint first (without changing its logits) and
    return name prefixes transformers may find unexpected on reloading the export; `reload=False`
    skips that reload (a model_type transformers does not know)."""
    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    unexpected = (prepare(source) if prepare is not None else None) or ()
    tokens = torch.randint(0, hf.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, tokens)

    devices, parallel = layouts[layout]
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=2, start_method="fork", **parallel),
        callbacks=[SaveLogitsAndExport(tmp_path)],
    )
    module = PretrainModule(str(source), **module_kwargs)
    trainer.predict(module, DataLoader([{"tokens": t} for t in tokens], batch_size=2))

    logits = torch.load(tmp_path / "logits.pt")
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4

    exported = tmp_path / "export"
    original, written = tensors(source), tensors(exported)
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    assert not list(tmp_path.glob(".export.tmp-*")), "temporary export directory left behind"
    if not reload:
        return

    reloaded, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not [k for k in info["unexpected_keys"] if not k.startswith(tuple(unexpected))], info
    torch.testing.assert_close(hf_logits(reloaded.eval(), tokens), expected, rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_logits_and_export_match_transformers(family, layout, tmp_path):
    check_logits_and_export(family, layout, tmp_path)


@pytest.mark.distributed
def test_sharded_checkpoint_in_and_out_at_tp2(tmp_path):
    """A multi-file source (index + shards) loads; the export is written shard by shard."""
    source = tmp_path / "source"
    hf = make_hf_model("llama", source)
    hf.save_pretrained(source, max_shard_size="60KB")
    (source / "model.safetensors").unlink(missing_ok=True)
    assert (source / "model.safetensors.index.json").is_file()
    for f in (Path(__file__).parents[1] / "configs" / "sample_data" / "tokenizer").iterdir():
        shutil.copy(f, source / f.name)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))

    trainer = L.Trainer(
        accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=2, start_method="fork", tensor_model_parallel_size=2),
        callbacks=[SaveLogitsAndExport(tmp_path, max_shard_bytes=60_000)],
    )
    trainer.predict(PretrainModule(str(source)), DataLoader([{"tokens": t} for t in tokens], batch_size=2))

    assert (torch.load(tmp_path / "logits.pt") - hf_logits(hf, tokens)).abs().max() <= 1e-4
    exported = tmp_path / "export"
    files = sorted(p.name for p in exported.glob("model-*.safetensors"))
    assert len(files) > 2 and files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    original, written = tensors(source), tensors(exported)
    assert written.keys() == original.keys()
    assert all(torch.equal(written[n], t) for n, t in original.items())
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (source / name).read_bytes(), name
