"""Knowledge distillation: a student learns a frozen teacher's next-token distributions.

Batches are SFT's (SFTDataModule: packed rows, loss on assistant tokens). The teacher, an HF
directory or one of our checkpoints with the student's vocabulary and tokenizer, is built and
sharded exactly like the student (same TP/PP layout, its own architecture) and runs forward-only,
without gradients. Without pipeline parallelism it runs inside each microbatch's forward step, just
before the student: its vocab-parallel logits live for one microbatch (micro_batch x seq x vocab /
TP values per rank). With a pipeline it runs at the start of every step over the whole batch
(strategy.forward_collect), and its last stage keeps the logits of every microbatch for the
student's loss: rows x seq x vocab / TP floats (fp32) per rank, on every pipeline stage (they
travel with the batch). Either way a second set of (frozen) weights sits beside the student's.

Per assistant token (objectives/distill_loss.py, without gathering the vocabulary):

    loss = sft_weight * CE(student, label) + (1 - sft_weight) * D_T(teacher, student)

with D one of forward_kl (KL(teacher || student)), reverse_kl or jsd (GKD's generalized JSD with
`beta`), both models' logits divided by `temperature`; summed over tokens and divided by their
count over the global batch (objectives/loss.py). Metrics: loss, divergence, ce.

Off-policy only: the student learns on the data's completions. GKD's on-policy mix (`lmbda`,
the student's own samples) needs generation, which training does not have yet.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from megatron.core import parallel_state
from transformers import AutoTokenizer

from lightning_mcore import models
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.objectives.distill_loss import token_cross_entropy, token_divergence
from lightning_mcore.objectives.frozen import WithFrozenModel
from lightning_mcore.sequence.packing import packed_seq_params
from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.optimizer import OptimizerSettings


@dataclasses.dataclass
class DistillSettings:
    """The distillation loss (DistillModule's `distill`): which divergence, at which
    temperature, mixed with how much of the SFT loss.

    `divergence`: forward_kl (KL(teacher || student), mode-covering), reverse_kl (KL(student ||
    teacher), mode-seeking) or jsd (GKD's generalized Jensen-Shannon with `beta`: 0 is forward_kl,
    1 reverse_kl). `temperature` divides both models' logits. `sft_weight`: the share of the
    cross-entropy on the data's labels in the loss (0: distillation only). `lmbda`: GKD's share of
    on-policy (student-generated) batches; only 0 is supported."""

    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    sft_weight: float = 0.0
    lmbda: float = 0.0

    def __post_init__(self) -> None:
        if self.divergence not in ("forward_kl", "reverse_kl", "jsd"):
            raise ValueError(f"divergence must be 'forward_kl', 'reverse_kl' or 'jsd', got {self.divergence!r}.")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}.")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if not 0.0 <= self.sft_weight <= 1.0:
            raise ValueError(f"sft_weight must be in [0, 1], got {self.sft_weight}.")
        if self.lmbda != 0.0:
            raise ValueError(
                f"lmbda={self.lmbda}: on-policy distillation (student-generated completions) needs "
                f"generation during training, which is not supported yet; use lmbda=0 (off-policy)."
            )


@dataclasses.dataclass
class Teacher:
    """Where the teacher's weights come from, in the fields _build_chunks reads."""

    model_config: GPTConfig
    hf_family: str
    hf_path: Optional[str]
    init_checkpoint: Optional[str]
    tokenizer_path: Optional[str]


def read_teacher(path: Union[str, os.PathLike], seq_length: int, overrides: Optional[dict] = None) -> Teacher:
    """The teacher at `path` (an HF directory or one of our checkpoints) at the student's
    seq_length; `overrides` change its config fields."""
    overrides = {"seq_length": seq_length, **(overrides or {})}
    if checkpoint_io.is_checkpoint(path):
        saved = checkpoint_io.read_saved_model(path)
        if saved.lora:
            raise ValueError(
                f"teacher={path} is a LoRA checkpoint (it holds adapters only): export it merged "
                f"(lightning-mcore export --mode merged) and give that directory as the teacher."
            )
        return Teacher(dataclasses.replace(saved.config, **overrides), saved.hf_family, saved.hf_path,
                       str(path), saved.tokenizer_path or saved.hf_path)
    if not os.path.isdir(path):
        raise ValueError(f"teacher={path} is not a directory: give a Hugging Face model directory "
                         f"or a MegatronStrategy checkpoint (runs/x/checkpoints/last.ckpt).")
    config, family = models.gpt_config_from_hf(path, **overrides)
    return Teacher(config, family, str(path), None, str(path))


def same_tokenizer(a: Union[str, os.PathLike], b: Union[str, os.PathLike]) -> bool:
    """Both directories' tokenizers map the same strings to the same ids (added tokens too)."""
    files = ("tokenizer.json",)
    if all((Path(d) / f).is_file() for d in (a, b) for f in files) and all(
            (Path(a) / f).read_bytes() == (Path(b) / f).read_bytes() for f in files):
        return True
    vocabs = []
    for directory in (a, b):
        try:
            vocabs.append(AutoTokenizer.from_pretrained(str(directory)).get_vocab())
        except Exception as error:  # noqa: BLE001 - whatever transformers says, named with the file
            raise ValueError(f"the tokenizer in {directory} cannot be read ({type(error).__name__}: "
                             f"{error}); the teacher's tokenizer cannot be compared.") from error
    return vocabs[0] == vocabs[1]


def _has_tokenizer(directory) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "vocab.json")
    return directory is not None and any((Path(directory) / n).is_file() for n in names)


class DistillModule(WithFrozenModel, MegatronModule):
    """Knowledge distillation: the student (`model`) learns a frozen teacher's next-token
    distributions on the data's tokens.

    `teacher`: an HF directory or a MegatronStrategy checkpoint with the student's vocabulary
    and tokenizer (`teacher_overrides` change its config fields); `distill`: the loss
    (DistillSettings)."""

    packed_sequences = True

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
        lora: Optional[LoRAConfig] = None,
        teacher: Optional[str] = None,
        distill: Optional[DistillSettings] = None,
        teacher_overrides: Optional[dict] = None,
    ) -> None:
        super().__init__(model, optim, model_overrides, lora)
        if teacher is None:
            raise ValueError("teacher is required: an HF model directory or a MegatronStrategy "
                             "checkpoint with the student's tokenizer.")
        self.distill = distill or DistillSettings()
        self.teacher = read_teacher(teacher, self.model_config.seq_length, teacher_overrides)
        self._check_teacher(str(teacher))

    def _check_teacher(self, teacher: str) -> None:
        """The teacher's logits index the student's vocabulary: the same size, padding and ids."""
        mine, theirs = self.model_config, self.teacher.model_config
        source = self.init_checkpoint or self.hf_path
        student = f"the student ({source})" if source else "the student"
        if theirs.vocab_size != mine.vocab_size:
            raise ValueError(
                f"teacher={teacher} has vocab_size={theirs.vocab_size}, {student} "
                f"vocab_size={mine.vocab_size}: distillation compares next-token distributions over "
                f"one vocabulary; use a teacher with the student's tokenizer."
            )
        if theirs.make_vocab_size_divisible_by != mine.make_vocab_size_divisible_by:
            raise ValueError(
                f"teacher={teacher} pads its vocab to a multiple of {theirs.make_vocab_size_divisible_by}, "
                f"{student} to {mine.make_vocab_size_divisible_by}: set "
                f"teacher_overrides.make_vocab_size_divisible_by={mine.make_vocab_size_divisible_by}."
            )
        if not _has_tokenizer(self.teacher.tokenizer_path):
            rank_zero_warn(f"teacher={teacher} has no tokenizer files: only its vocab_size could be "
                           f"checked against the student's; make sure both share one tokenizer.")
        mine_tok = self.hf_path or self.tokenizer_path
        if _has_tokenizer(mine_tok):
            self.check_tokenizer(mine_tok, f"the student's tokenizer ({mine_tok})")

    def check_tokenizer(self, tokenizer: Union[str, os.PathLike], what: Optional[str] = None) -> None:
        """Refuse a teacher whose tokenizer differs from `tokenizer` (the data's or the
        student's); a teacher without tokenizer files cannot be checked and passes."""
        theirs = self.teacher.tokenizer_path
        if not (_has_tokenizer(theirs) and _has_tokenizer(tokenizer)):
            return
        if not same_tokenizer(theirs, tokenizer):
            raise ValueError(
                f"the teacher's tokenizer ({theirs}) differs from {what or f'the tokenizer {tokenizer}'}: "
                f"the same token ids would mean different text to the two models; use a teacher "
                f"and a student that share one tokenizer."
            )

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.tokenizer_path is not None:  # the data's (the CLI checks it before launching)
            self.check_tokenizer(self.tokenizer_path, f"the data's ({self.tokenizer_path})")

    def _frozen_source(self) -> Teacher:
        """The teacher, whatever the student (with LoRA too): its frozen copy is _reference."""
        return self.teacher

    # ---------------------------------------------------------------- steps
    def _teacher_logits(self, batch: dict) -> torch.Tensor:
        """[rows, seq, vocab / tp]: the teacher's logits of this rank's vocab slice."""
        strategy = self._strategy()
        rows, seq = batch["tokens"].shape
        width = self.teacher.model_config.padded_vocab_size(strategy.parallel.tensor_model_parallel_size)
        width //= strategy.parallel.tensor_model_parallel_size

        def step(mb, chunk):
            return _packed_logits(chunk, mb), lambda out: out.reshape(mb["tokens"].shape[0], -1)

        logits = self._frozen_collect(batch, step, seq * width)
        return logits.reshape(rows, seq, width)

    def forward_step(self, batch: dict, chunk):
        teacher_logits = batch.get("teacher_logits")
        if teacher_logits is None:  # no pipeline: the teacher's one chunk, this microbatch only
            with torch.no_grad():
                teacher_logits = _packed_logits(self._reference.chunks[0], batch)
        out = _packed_logits(chunk, batch)

        def loss_fn(logits):
            group = parallel_state.get_tensor_model_parallel_group()
            logits = logits.reshape(-1, logits.shape[-1])
            teacher = teacher_logits.reshape(logits.shape[0], -1)
            vocab, s = self.model_config.vocab_size, self.distill
            divergence = token_divergence(logits, teacher, vocab, group, s.divergence, s.beta, s.temperature)
            ce = token_cross_entropy(logits, batch["labels"].reshape(-1), vocab, group)
            losses = s.sft_weight * ce + (1.0 - s.sft_weight) * divergence
            mask = batch["loss_mask"].reshape(-1).float()
            count = mask.sum()
            report = {name: torch.stack([(v.detach() * mask).sum(), count])
                      for name, v in (("loss", losses), ("divergence", divergence), ("ce", ce))}
            return (losses * mask).sum(), count.to(torch.int), report

        return out, loss_fn

    def _with_reference(self, batch: dict) -> dict:
        if self._strategy().parallel.pipeline_model_parallel_size == 1:
            return batch  # the teacher runs in forward_step
        return {**batch, "teacher_logits": self._teacher_logits(batch)}


def _packed_logits(chunk, batch: dict):
    """One microbatch through a chunk as a single THD row (sequence/packing.py): vocab-parallel
    logits [1, micro_batch * seq, vocab / tp] on the last stage, hidden states elsewhere."""
    flat = {k: batch[k].reshape(1, -1) for k in ("tokens", "position_ids")}
    return chunk(input_ids=flat["tokens"], position_ids=flat["position_ids"], attention_mask=None,
                 labels=None, packed_seq_params=packed_seq_params(batch["segment_ids"]))
