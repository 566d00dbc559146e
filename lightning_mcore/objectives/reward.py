"""Reward models: a scalar score at the last token, trained with a Bradley-Terry loss on pairs.

The model is the family's GPTModel chunks as usual; on the last pipeline stage the output layer
is replaced by a score head: one weight row [1, hidden], no bias, the same on every
tensor-parallel rank (replicated: one row does not split), transformers' `score` linear. It
takes ColumnParallelLinear's call, so GPTModel.forward without labels returns per-token scores
[b, s, 1]. With sequence parallelism the hidden states reaching it are sequence-sharded: they
are gathered first, and as every rank then holds the whole gradient, its backward only splits.
With tied embeddings the embedding stays (untied from the head: no embedding gradient is shared
between stages any more).

Batches are the DPO data module's: one row per pair, [prompt + chosen | prompt + rejected] as
segments 1 and 2 (packed, so the two never attend to each other). A conversation's score is the
head's output at its last token, as transformers' `...ForSequenceClassification` scores the
last token that is not padding:

    loss = -log sigmoid(r_chosen - r_rejected - margin)     (margin: per pair, default 0)

`margin` ([rows], when a batch carries one: RewardDataModule's margin column) is the per-pair
margin of the Llama 2 paper. `score(sequences)` gives a trained model's scores of token lists
on every rank (collective), e.g. as a reward function for GRPO.

Weights: an HF `...ForSequenceClassification` directory (num_labels=1) loads whole, its `score`
included; a causal LM directory starts the head at zero (every pair scores equal at first:
loss log 2, accuracy 0); a GPTConfig draws it like every other weight. Exports write that
layout: the backbone as the causal LM's `model.*`, `score.weight`, `architectures` the family's
scalar-head class, num_labels=1 and a pad_token_id (transformers needs one to find the last
token): the source config's, else the tokenizer's pad token, else its eos token. transformers
scores the last token that is not padding, so a conversation that ends with the pad token (pad =
eos, as many tokenizers set it) is scored one token earlier there than here: the export warns.
Checkpoints record the head (`output_head`), so `lightning-mcore export` writes this layout too
and a causal-LM module refuses a reward checkpoint (and the other way round).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from megatron.core import tensor_parallel
from transformers import AutoTokenizer

from lightning_mcore import models
from lightning_mcore.hf.export import export_hf
from lightning_mcore.hf.load import unwrap
from lightning_mcore.hf.score_head import reward_weights, seq_cls_config
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.config import GPTConfig, refuse_longer
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.sequence.packing import packed_seq_params
from lightning_mcore.strategy.optimizer import OptimizerSettings

METRICS = ("loss", "accuracy", "reward_gap", "rewards/chosen", "rewards/rejected")


class ScoreHead(torch.nn.Module):
    """hidden [s, b, h] -> (scores [s, b, 1], None), in the output layer's place and call."""

    def __init__(self, hidden: int, sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.sequence_parallel = sequence_parallel  # GPTModel's inference path reads it

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight), None


def last_token_scores(scores: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """[rows, 2]: (chosen, rejected) scores at the last token of segments 1 and 2 of each row."""
    rows, seq = segment_ids.shape
    scores = scores.float().reshape(rows, seq)
    position = torch.arange(seq, device=segment_ids.device).expand(rows, seq)
    out = []
    for segment in (1, 2):
        last = torch.where(segment_ids == segment, position, -1).max(-1).values
        out.append(scores.gather(1, last.clamp(min=0)[:, None])[:, 0])
    return torch.stack(out, dim=-1)


def bradley_terry(scores: torch.Tensor, margin: Optional[torch.Tensor] = None):
    """Per-pair losses and metrics from [pairs, 2] (chosen, rejected) scores."""
    chosen, rejected = scores[:, 0], scores[:, 1]
    gap = chosen - rejected
    losses = -F.logsigmoid(gap - (0.0 if margin is None else margin.float()))
    metrics = {"loss": losses, "accuracy": (chosen > rejected).float(), "reward_gap": gap,
               "rewards/chosen": chosen, "rewards/rejected": rejected}
    return losses, metrics


class RewardModule(MegatronModule):
    """A reward model trained on preference pairs (DPODataModule batches). `model`: an HF
    `...ForSequenceClassification` or causal LM directory, one of our checkpoints of a reward
    model, or a GPTConfig (the family it exports as must have a scalar-head class:
    models.sequence_classifier). Trains the whole model (no LoRA yet)."""

    packed_sequences = True
    output_head = "score"  # recorded in checkpoints: `lightning-mcore export` writes this layout

    def __init__(
        self,
        model: Union[GPTConfig, str],
        optim: Optional[OptimizerSettings] = None,
        model_overrides: Optional[dict] = None,
        lora: Optional[LoRAConfig] = None,
    ) -> None:
        super().__init__(model, optim, model_overrides, lora)
        if lora is not None:
            raise ValueError("RewardModule trains the whole model; LoRA (which would leave the "
                             "score head out of the adapters) is not supported yet: drop `lora`.")
        self.seq_cls_class = models.sequence_classifier(self.model_config, self.hf_family)
        self.hf_scores = (self.init_checkpoint is None and self.hf_path is not None
                          and models.is_sequence_classifier(self.hf_path))

    # ------------------------------------------------------------ model
    def _adapt_chunks(self, chunks: list) -> None:
        attach_score_heads(chunks)

    def _weights(self):
        return reward_weights(super()._weights(), self.model_config.hidden_size)

    def _import_weights(self):
        return reward_weights(super()._weights(), self.model_config.hidden_size,
                              fresh=not self.hf_scores)

    # ------------------------------------------------------------ steps
    def forward_step(self, batch: dict, chunk):
        segments = batch["segment_ids"]
        if not bool(((segments.amax(-1) == 2) & (segments == 1).any(-1)).all()):
            raise ValueError(
                "RewardModule needs rows of one pair each, chosen then rejected (segment ids 1 "
                "and 2, then padding), as RewardDataModule / DPODataModule make them; got rows "
                f"with segment ids up to {int(segments.max())}.")
        out = chunk(input_ids=batch["tokens"].reshape(1, -1),
                    position_ids=batch["position_ids"].reshape(1, -1), attention_mask=None,
                    packed_seq_params=packed_seq_params(batch["segment_ids"]))

        def loss_fn(scores):
            losses, metrics = bradley_terry(last_token_scores(scores, batch["segment_ids"]),
                                            batch.get("margin"))
            pairs = torch.tensor(losses.numel(), device=losses.device)
            report = {k: torch.stack([v.detach().float().sum(), pairs.float()]) for k, v in metrics.items()}
            return losses.sum(), pairs.to(torch.int), report

        return out, loss_fn

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        """[n] scores of token sequences (each at its last token), on every rank (collective):
        e.g. a reward function for GRPO. Rows are right-padded to one length (causal attention:
        padding after a token does not change its score)."""
        strategy = self._strategy()
        strategy.refuse_context_parallel("RewardModule.score")
        tp = strategy.parallel.tensor_model_parallel_size
        longest = max(len(s) for s in sequences)
        refuse_longer(longest, self.model_config.seq_length, "RewardModule.score: sequences")
        seq = -(-longest // tp) * tp  # sequence parallelism splits the row over TP ranks
        device = strategy.root_device
        micro = []
        for tokens in sequences:
            row = torch.zeros(1, seq, dtype=torch.long, device=device)
            row[0, :len(tokens)] = torch.tensor(tokens, device=device)
            micro.append({"tokens": row, "last": len(tokens) - 1})

        def step(mb, chunk):
            out = chunk(input_ids=mb["tokens"], attention_mask=None,
                        position_ids=torch.arange(seq, device=device)[None])
            return out, lambda scores: scores[:, mb["last"], 0].reshape(1, 1)

        return strategy.forward_only(micro, step, list(self.chunks), (seq, 1),
                                     (len(sequences), 1))[:, 0]

    # ------------------------------------------------------------ export
    def save_hf_checkpoint(self, directory, max_shard_bytes: int = 5 * 2**30, mode: str = "full",
                           overwrite: bool = False, lora_experts_layout: Optional[str] = None):
        """Write the model as a Hugging Face `...ForSequenceClassification` directory
        (collective: call on every rank); see MegatronModule.save_hf_checkpoint."""
        self.check_hf_export(mode, lora_experts_layout)
        strategy = self._strategy()
        strategy.refuse_nonfinite_weights(f"the HF export {directory}")
        padded = self.model_config.padded_vocab_size(strategy.parallel.tensor_model_parallel_size)
        return export_hf(list(self.chunks), self.model_config, self._weights(), self._export_config(),
                         directory, padded, source_dir=self.hf_path,
                         max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                         tokenizer_dir=self.tokenizer_path, protected=[self.init_checkpoint])

    def _export_config(self) -> dict:
        return seq_cls_export_config(self.model_config, self.hf_family, self.hf_path, self.tokenizer_path)


def attach_score_heads(chunks: list) -> None:
    """The score head in place of the output layer of the last stage's chunk; the embedding
    no longer tied to it."""
    for chunk in chunks:
        model = unwrap(chunk)
        model.share_embeddings_and_output_weights = False  # no gradient shared between stages
        if model.post_process:
            config = model.config
            model.output_layer = ScoreHead(config.hidden_size, config.sequence_parallel,
                                           config.params_dtype)


def seq_cls_export_config(cfg: GPTConfig, family: Optional[str], hf_path=None, tokenizer_path=None) -> dict:
    """config.json of a reward model's export: the source's (else one made from `cfg`) as the
    family's scalar-head class, pad_token_id the source's, else the tokenizer's pad, else eos."""
    source = Path(hf_path) if hf_path else None
    if source is not None and (source / "config.json").is_file():
        config = json.loads((source / "config.json").read_text())
    else:
        config = models.hf_config_dict_from_gpt(cfg, family)
    pad, eos = config.get("pad_token_id"), config.get("eos_token_id")
    if pad is None:
        pad, eos = _tokenizer_pad_id(source if source is not None else tokenizer_path)
    if pad is not None and pad in (eos if isinstance(eos, list) else [eos]):
        rank_zero_warn(f"the reward model export's pad_token_id {pad} is also an eos token: "
                       f"transformers scores the last token that is not padding, so a sequence "
                       f"ending in it is scored one token earlier there than in training; set a "
                       f"pad_token_id that no sequence ends with in config.json.")
    return seq_cls_config(config, models.sequence_classifier(cfg, family), pad)


def _tokenizer_pad_id(directory) -> tuple[Optional[int], Optional[int]]:
    """(the tokenizer's pad token id, else its eos token id; its eos token id), or Nones
    without a tokenizer."""
    if directory is None or not (Path(directory) / "tokenizer_config.json").is_file():
        return None, None

    tokenizer = AutoTokenizer.from_pretrained(directory)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    return (eos if pad is None else pad), eos
