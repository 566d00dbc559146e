"""Acceptance (vision-language training, issue 24): LoRA on the decoder of a tiny Qwen2.5-VL /
Qwen3-VL trains on multimodal rows and exports a PEFT adapter that peft loads on transformers'
model with our logits (1e-4, fp32), touching no vision module; the merged export equals peft's
merge_and_unload. Freezing keeps exactly the chosen parts bitwise unchanged. A full fine-tune
resumed from its step-2 checkpoint (vision encoder included) continues with the same losses."""

import json

import lightning as L
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from test_hf_roundtrip import tensors
from toy import RecordLosses, StopAfter
from vlm_models import batch, hf_logits, make_vlm, sample
from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.cli import main
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.objectives.vision_language import Freezing, VisionLanguageSFTModule

SEQ = 48
TEXT_VOCAB = 280  # sample() draws text tokens below this; image and vision tokens are above
LAYOUTS = {"tp1": (1, {}), "tp2": (2, dict(tensor_model_parallel_size=2)),
           "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True))}


def training_rows(hf, seed: int) -> dict:
    """Two multimodal rows (one with two packed samples) whose labels are the next tokens of
    each sample, counted where that next token is text."""
    gen = torch.Generator().manual_seed(seed)
    rows = [[sample(hf, [[1, 4, 4]], SEQ, gen)],
            [sample(hf, [[1, 2, 4]], SEQ // 2, gen), sample(hf, [[1, 4, 2], [1, 2, 2]], SEQ // 2, gen)]]
    data = batch(hf, rows)
    tokens, segments = data["tokens"], data["segment_ids"]
    labels = torch.roll(tokens, -1, dims=1)
    same_sample = torch.roll(segments, -1, dims=1) == segments
    same_sample[:, -1] = False
    data["labels"] = labels
    data["loss_mask"] = (same_sample & (labels < TEXT_VOCAB)).float()
    return data


class Rows(Dataset):
    def __init__(self, data: dict) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data["tokens"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.data.items()}


def trainer_for(tmp_path, layout: str, steps: int, callbacks: list, rows: int = 2, **kwargs) -> L.Trainer:
    devices, parallel = LAYOUTS[layout]
    return L.Trainer(accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     default_root_dir=tmp_path, callbacks=callbacks,
                     strategy=MegatronStrategy(global_batch_size=rows, start_method="fork", **parallel),
                     **kwargs)


OPTIM = OptimizerSettings(lr=1e-2, warmup_steps=0)


class LogitsAndExports(L.Callback):
    """At the end of training: our logits of `data` and the exports of `modes` (rank 0 writes)."""

    def __init__(self, out, data: dict, modes: tuple) -> None:
        self.out, self.data, self.modes = out, data, modes

    def on_train_end(self, trainer, pl_module):
        logits = pl_module.predict_step(self.data, 0)
        for mode in self.modes:
            pl_module.save_hf_checkpoint(self.out / mode, mode=mode)
        if trainer.global_rank == 0:
            torch.save(logits, self.out / "logits.pt")


def family_class(family: str):
    return {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
            "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[family]


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", [("qwen2_5_vl", "tp1"), ("qwen2_5_vl", "tp2"), ("qwen3_vl", "tp2_sp")])
def test_lora_peft_export_loads_in_peft_with_our_logits(family, layout, tmp_path):
    from peft import PeftModel

    source = tmp_path / "source"
    hf = make_vlm(family, source)
    gen = torch.Generator().manual_seed(7)
    probes = [sample(hf, [[1, 4, 4]], SEQ, gen), sample(hf, [[1, 2, 4], [1, 4, 2]], SEQ, gen)]
    lora = LoRAConfig(target_modules="all-linear", rank=4, alpha=8.0)
    trainer = trainer_for(tmp_path, layout, 3, [LogitsAndExports(tmp_path, batch(hf, [[p] for p in probes]),
                                                                 ("peft", "merged", "full")),
                                                ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)])
    trainer.fit(VisionLanguageSFTModule(str(source), OPTIM, lora=lora),
                DataLoader(Rows(training_rows(hf, 1)), batch_size=2))
    ours = torch.load(tmp_path / "logits.pt")
    base = torch.stack([hf_logits(hf, p) for p in probes])
    assert (ours - base).abs().max().item() > 1e-3, "the adapters changed nothing"

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    model = PeftModel.from_pretrained(family_class(family).from_pretrained(source), tmp_path / "peft").eval()
    adapted = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A))
    layers, linears = hf.config.text_config.num_hidden_layers, 7
    assert len(adapted) == layers * linears, adapted
    assert all(".language_model.layers." in n for n in adapted), adapted  # no vision module
    loaded = torch.stack([hf_logits(model, p) for p in probes])
    assert (loaded - ours).abs().max().item() <= 1e-4

    merged_ref = model.merge_and_unload().state_dict()
    for mode in ("merged", "full"):
        merged = family_class(family).from_pretrained(tmp_path / mode).state_dict()
        assert merged.keys() == merged_ref.keys()
        for name, tensor in merged_ref.items():
            torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    original, written = tensors(source), tensors(tmp_path / "merged")
    assert written.keys() == original.keys()
    assert tensors(tmp_path / "full").keys() == original.keys()
    for name, tensor in original.items():
        if "visual." in name:  # the vision encoder is frozen and exported bit for bit
            assert torch.equal(written[name], tensor), name
        assert torch.equal(tensors(tmp_path / "full")[name], written[name]), name
    if layout == "tp1":  # the export command rebuilds base, vision encoder and adapters alike
        saved, = (tmp_path / "ckpt").glob("*step=3.ckpt")
        for mode in ("peft", "merged"):
            assert_command_export_equals(saved, tmp_path / mode, mode)


def assert_command_export_equals(checkpoint, directory, mode: str) -> None:
    """`lightning-mcore export` of `checkpoint` (in-process) writes the tensors of `directory` bit
    for bit."""
    out = directory.with_name(f"cmd-{mode}")
    main(["export", "--checkpoint", str(checkpoint), "--output", str(out), "--mode", mode])
    a, b = tensors(directory), tensors(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (mode, sorted(a)[:3], sorted(b)[:3])


PARTS = ("vit", "aligner", "llm")


def part_of(hf_name: str) -> str:
    """Which Freezing field covers a Qwen3-VL checkpoint tensor."""
    if not hf_name.startswith("model.visual."):
        return "llm"
    return "aligner" if "merger" in hf_name.split(".")[2] else "vit"


class OptimizedParameters(L.Callback):
    """Rank 0 writes whether the optimizer holds exactly the trainable parameters."""

    def __init__(self, out) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        held = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        trainable = {id(p) for p in pl_module.parameters() if p.requires_grad}
        frozen = {id(p) for p in pl_module.parameters() if not p.requires_grad}
        (self.out / "optimizer.json").write_text(json.dumps(
            {"exact": held == trainable, "frozen_held": len(held & frozen), "trainable": len(trainable)}))


@pytest.mark.parametrize("frozen", [("vit",), ("aligner",), ("llm",), ("vit", "llm")])
def test_freezing_keeps_frozen_parts_bitwise(frozen, tmp_path):
    source = tmp_path / "source"
    hf = make_vlm("qwen3_vl", source)  # deepstack: two kinds of merger
    freeze = Freezing(**{part: True for part in frozen})
    trainer = trainer_for(tmp_path, "tp1", 2, [LogitsAndExports(tmp_path, training_rows(hf, 2), ("full",)),
                                                OptimizedParameters(tmp_path)], enable_checkpointing=False)
    trainer.fit(VisionLanguageSFTModule(str(source), OPTIM, freeze=freeze),
                DataLoader(Rows(training_rows(hf, 1)), batch_size=2))

    facts = json.loads((tmp_path / "optimizer.json").read_text())
    assert facts["exact"] and facts["frozen_held"] == 0 and facts["trainable"] > 0
    original, written = tensors(source), tensors(tmp_path / "full")
    assert written.keys() == original.keys()
    seen = set()
    for name, tensor in original.items():
        part = part_of(name)
        seen.add(part)
        if part in frozen:
            assert torch.equal(written[name], tensor), f"{name} ({part}) is frozen but changed"
        else:
            assert not torch.equal(written[name], tensor), f"{name} ({part}) trains but did not change"
    assert seen == set(PARTS)


def test_freezing_everything_or_with_lora_is_refused(tmp_path):
    make_vlm("qwen2_5_vl", tmp_path)
    with pytest.raises(ValueError, match="leaves nothing to train"):
        VisionLanguageSFTModule(str(tmp_path), freeze=Freezing(vit=True, aligner=True, llm=True))
    with pytest.raises(ValueError, match="with lora: LoRA adapts the decoder's linears and keeps every base"):
        VisionLanguageSFTModule(str(tmp_path), lora=LoRAConfig(), freeze=Freezing(vit=True))


def fit_full(tmp_path, source, hf, name: str, stop=None, ckpt_path=None) -> list:
    """Four full fine-tuning steps on the same two rows (one step an epoch), checkpoints every
    2 steps, an HF export at the end (`name`/full); rank 0's losses."""
    callbacks = [RecordLosses(tmp_path / f"{name}.json"),
                 ModelCheckpoint(dirpath=tmp_path / f"{name}-ckpts", every_n_train_steps=2, save_top_k=-1),
                 LogitsAndExports(tmp_path / name, training_rows(hf, 2), ("full",))]
    (tmp_path / name).mkdir()
    if stop:
        callbacks.append(StopAfter(stop))
    trainer = trainer_for(tmp_path, "tp1", 4, callbacks)
    trainer.fit(VisionLanguageSFTModule(str(source), OPTIM), DataLoader(Rows(training_rows(hf, 1)), batch_size=2),
                ckpt_path=ckpt_path)
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_resume_restores_the_vision_encoder(tmp_path):
    from megatron.core import dist_checkpointing

    source = tmp_path / "source"
    hf = make_vlm("qwen2_5_vl", source)
    straight = fit_full(tmp_path, source, hf, "straight")
    assert len(straight) == 4 and straight[-1] < straight[0]
    fit_full(tmp_path, source, hf, "first", stop=2)
    saved, = (tmp_path / "first-ckpts").glob("*step=2.ckpt")
    keys = dist_checkpointing.load_tensors_metadata(str(saved / "weights"))
    vision = {k for k in keys if k.startswith("visual.")}
    assert {f"visual.{n}" for n, _ in hf.model.visual.named_parameters()} <= vision
    resumed = fit_full(tmp_path, source, hf, "resumed", ckpt_path=str(saved))
    assert len(resumed) == 2
    for got, want in zip(resumed, straight[2:]):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed, straight)
    original, trained = tensors(source), tensors(tmp_path / "straight" / "full")
    assert trained.keys() == original.keys()
    assert all(not torch.equal(trained[k], original[k]) for k in original if k.startswith("visual."))
    last, = (tmp_path / "straight-ckpts").glob("*step=4.ckpt")
    assert_command_export_equals(last, tmp_path / "straight" / "full", "merged")
