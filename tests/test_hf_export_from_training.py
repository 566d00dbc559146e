"""Acceptance (checkpoints, HF export): the HFExport callback's directory equals what
`lightning-mcore export` makes of the saved checkpoint, and both load in transformers with the
trained mcore model's logits; a checkpoint also starts a fine-tuning run (weights only)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import hf_logits, make_hf_model
from lightning_mcore import HFExport, MegatronStrategy, OptimizerSettings, PretrainModule
from test_export_safety import forked_export
from toy import TokenRows

TOKENS = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(3))


class SaveLogits(L.Callback):
    """Rank 0 saves the model's full-vocabulary logits of TOKENS when `hook` runs."""

    def __init__(self, out, hook: str) -> None:
        self.out = out
        setattr(self, hook, self._save)

    def _save(self, trainer, pl_module):
        logits = trainer.lightning_module.forward_logits(TOKENS)
        if trainer.global_rank == 0:
            torch.save(logits, self.out)


def train(tmp_path, model, devices, steps, callbacks, **parallel):
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_progress_bar=False,
        default_root_dir=tmp_path,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        strategy=MegatronStrategy(global_batch_size=4, micro_batch_size=2, start_method="fork", **parallel),
    )
    data = DataLoader(TokenRows(n=32, seq=16, vocab=200), batch_size=4)
    trainer.fit(PretrainModule(model, OptimizerSettings(lr=1e-2)), data)


def tensors(directory):
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.distributed
def test_callback_export_equals_export_command_and_transformers(tmp_path):
    source = tmp_path / "source"
    make_hf_model("llama", source)
    ckpts = tmp_path / "ckpts"
    train(tmp_path, str(source), 2, 3, [
        ModelCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=-1),
        HFExport(tmp_path / "hf", every_n_train_steps=2),
        SaveLogits(tmp_path / "trained.pt", "on_train_end"),
    ], tensor_model_parallel_size=2)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step=2", "step=3"]
    from_callback = tmp_path / "hf" / "step=3"

    command = tmp_path / "command"
    saved = ckpts / "epoch=0-step=3.ckpt"
    code, err = forked_export(["--checkpoint", saved, "--output", command])  # the command's main
    assert code == 0, err[-2000:]
    a, b = tensors(from_callback), tensors(command)
    assert a.keys() == b.keys() == tensors(source).keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], v) for k, v in tensors(source).items()), "training changed nothing"
    assert (from_callback / "config.json").read_text() == (command / "config.json").read_text()

    trained = torch.load(tmp_path / "trained.pt")
    reloaded = AutoModelForCausalLM.from_pretrained(command).eval()
    assert (hf_logits(reloaded, TOKENS) - trained).abs().max().item() <= 1e-4

    # Fine-tuning from the TP=2 checkpoint at PP=2: the starting weights are the trained ones.
    train(tmp_path, str(saved), 2, 1, [SaveLogits(tmp_path / "start.pt", "on_train_start")],
          pipeline_model_parallel_size=2)
    assert (torch.load(tmp_path / "start.pt") - trained).abs().max().item() <= 1e-5


def test_export_command_refuses_a_non_checkpoint(tmp_path, capsys):
    """Refused before any process group: the console command's `main`, in this process."""
    from lightning_mcore.cli import main

    with pytest.raises(SystemExit) as info:
        main(["export", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "out")])
    assert info.value.code not in (0, None)
    assert "is not a MegatronStrategy checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
