"""Shared test helpers: a tiny model config, a toy token dataset, a fork-launched fit."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_mcore import GPTConfig, MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.data import PretrainDataModule

ROOT = Path(__file__).parents[1]


def tiny_config(**overrides) -> GPTConfig:
    base = dict(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=500, seq_length=32, transformer_impl="local",
    )
    base.update(overrides)
    return GPTConfig(**base)


class TokenRows(Dataset):
    """Fixed random token rows in the batch contract (tokens, labels, loss_mask, position_ids)."""

    def __init__(self, n: int = 64, seq: int = 32, vocab: int = 500, seed: int = 0, rows=None):
        gen = torch.Generator().manual_seed(seed)
        self.rows = rows if rows is not None else torch.randint(0, vocab, (n, seq + 1), generator=gen)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        seq = len(row) - 1
        mask = torch.ones(seq)
        mask[::7] = 0.0  # some masked labels, so the per-token reduction is exercised
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": mask,
                "position_ids": torch.arange(seq)}


class RecordLosses(L.Callback):
    """Rank 0 writes the per-step training loss (and optional weights) to `out`."""

    def __init__(self, out: Path, dump_weights: bool = False) -> None:
        self.out, self.losses, self.dump_weights = Path(out), [], dump_weights

    def on_fit_start(self, trainer, pl_module):
        if self.dump_weights:
            torch.save(sharded_weights(pl_module), self.out.with_suffix(f".init{trainer.global_rank}.pt"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_train_end(self, trainer, pl_module):
        if self.dump_weights:
            torch.save(sharded_weights(pl_module), self.out.with_suffix(f".end{trainer.global_rank}.pt"))
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.losses))


def sharded_weights(module) -> list:
    """(key, global offset, global shape, local tensor) for every weight of this rank."""
    from lightning_mcore.model.init import _sharded_tensors

    out = []
    for chunk in module.chunks:
        inner = chunk.module if hasattr(chunk, "module") else chunk
        for sh in _sharded_tensors(inner.sharded_state_dict()):
            if sh.data is not None and sh.data.is_floating_point():
                out.append((sh.key, tuple(sh.global_offset), tuple(sh.global_shape),
                            sh.data.detach().clone()))
    return out


def assemble(paths) -> dict:
    """Full tensors from the shards several ranks dumped (replicas simply overwrite)."""
    full: dict = {}
    for path in paths:
        for key, offset, shape, data in torch.load(path):
            t = full.setdefault(key, torch.full(shape, float("nan")))
            index = tuple(slice(o, o + n) for o, n in zip(offset, (1,) * (len(shape) - data.dim()) + tuple(data.shape)))
            t[index] = data.reshape(t[index].shape)
    return full


def fit(tmp_path: Path, devices: int = 1, steps: int = 3, gbs: int = 8, mbs: int = 2,
        config: GPTConfig | None = None, optim: OptimizerSettings | None = None,
        dataset: Dataset | None = None, dump_weights: bool = False, name: str = "run",
        module_cls=PretrainModule, accelerator: str = "cpu", precision: str = "32-true",
        start_method: str = "fork", module_kwargs: dict | None = None, callbacks: tuple = (),
        **parallel) -> list[float]:
    """Train `steps` optimizer steps with fork-launched gloo ranks; return rank 0's losses.
    `callbacks`: more Lightning callbacks."""
    config = config or tiny_config()
    strategy = MegatronStrategy(global_batch_size=gbs, micro_batch_size=mbs,
                                start_method=start_method, **parallel)
    tp = parallel.get("tensor_model_parallel_size", 1)
    pp = parallel.get("pipeline_model_parallel_size", 1)
    cp = parallel.get("context_parallel_size", 1)
    dp = devices // (tp * pp * cp)
    out = Path(tmp_path) / f"{name}.json"
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, logger=False,
        precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RecordLosses(out, dump_weights), *callbacks],
    )
    module = module_cls(config, optim or OptimizerSettings(lr=1e-3), **(module_kwargs or {}))
    data = dataset or TokenRows(seq=config.seq_length, vocab=config.vocab_size)
    trainer.fit(module, DataLoader(data, batch_size=gbs // dp))
    return json.loads(out.read_text())


class StopAfter(L.Callback):
    """Ends the run after `steps` optimizer steps, as an interruption would (max_steps unchanged)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def fit_with_checkpoints(tmp: Path, name: str, devices: int, stop: int = None, ckpt_path=None,
                         config=None, checkpoint=None, start_method="fork", accelerator="cpu",
                         optim: OptimizerSettings | None = None, precision: str = "32-true",
                         callbacks: tuple = (), fork_ranks: bool = False, **parallel):
    """6 steps of the tiny model on the sample text, checkpoints every 3 steps (+ last.ckpt);
    returns rank 0's per-step losses. `optim`: default Adam at lr 1e-3, 2 warmup steps;
    `callbacks`: more Lightning callbacks; `fork_ranks`: ranks forked from this process as the
    CLI forks them on CPU (with start_method None; the caller ends them, ending_forked_rank)."""
    out = tmp / f"{name}.json"
    callbacks = [RecordLosses(out), ModelCheckpoint(dirpath=tmp / f"{name}-ckpts", every_n_train_steps=3,
                                                    save_top_k=-1, save_last=True), *callbacks]
    if stop:
        callbacks.append(StopAfter(stop))
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, max_steps=6, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, precision=precision,
        strategy=MegatronStrategy(global_batch_size=8, micro_batch_size=2, start_method=start_method,
                                  checkpoint=checkpoint, **parallel),
    )
    if fork_ranks:
        trainer.strategy.fork_ranks()
    data = PretrainDataModule(paths=str(ROOT / "configs/sample_data/sample.txt"),
                              tokenizer=str(ROOT / "configs/sample_data/tokenizer"), seq_length=32,
                              shuffle=True, cache_dir=str(tmp / "cache"))
    module = PretrainModule(config or tiny_config(vocab_size=512), optim or OptimizerSettings(lr=1e-3, warmup_steps=2))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if trainer.global_rank != 0:  # launched by torchrun: only rank 0 recorded
        return []
    return json.loads(out.read_text())
