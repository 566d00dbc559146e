"""A custom loss in Python: next-token cross-entropy plus PaLM's z-loss, under tensor parallelism.

    python examples/custom_loss.py                       # 2 CPU processes, TP=2, 40 steps
    python examples/custom_loss.py --z-loss-weight 1e-3 --accelerator gpu --devices 2

z-loss (Chowdhery et al. 2022, PaLM) adds `weight * log(Z)^2` per token, Z = sum(exp(logits)),
which keeps the softmax normaliser near 1 and the logits from drifting. It needs the logits,
so the module asks its chunk for logits (no `labels`) instead of mcore's per-token losses.

What a custom objective must respect to stay correct at any layout:

* Under tensor parallelism each rank holds the logits of its slice of the vocabulary
  ([batch, seq, vocab / tp]); anything over the vocabulary (the cross-entropy's normaliser,
  log Z) is reduced across the tensor-parallel group. mcore's `vocab_parallel_cross_entropy`
  does so for the cross-entropy; `vocab_parallel_logsumexp` below does it for log Z.
* Under pipeline parallelism only the last stage has logits; `loss_fn` is only called there.
* The loss function returns the *sum* over the microbatch's tokens and the token count
  (lightning_mcore/objectives/loss.py); mcore divides by the total count over microbatches and
  data-parallel ranks, so micro batch size and gradient accumulation do not change the result.
"""

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from megatron.core import parallel_state, tensor_parallel

from lightning_mcore import (
    GPTConfig,
    MegatronStrategy,
    OptimizerSettings,
    PretrainModule,
)
from lightning_mcore.data import PretrainDataModule

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "configs" / "sample_data"


def vocab_parallel_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(logits))) over the whole vocabulary from this rank's vocab slice: [..., v/tp] -> [...].

    The max is a constant shift (no gradient) reduced with MAX; the sum of exponentials is reduced
    with mcore's reduce_from_tensor_model_parallel_region (all-reduce forward, identity backward:
    each rank's slice then gets exactly its share of the gradient, and mcore's output layer sums
    the input gradients of all slices, as it does for the cross-entropy)."""
    logits = logits.float()
    shift = logits.detach().amax(dim=-1)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    sum_exp = torch.exp(logits - shift.unsqueeze(-1)).sum(dim=-1)
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(sum_exp)
    return sum_exp.log() + shift


class ZLossPretrain(PretrainModule):
    """PretrainModule with `z_loss_weight * log(Z)^2` added to every token's cross-entropy.

    Logged per token (means over the global batch): `train/loss` (the objective), `train/ce`
    (the cross-entropy alone, PretrainModule's loss) and `train/z_loss` (log(Z)^2, unweighted)."""

    def __init__(self, *args, z_loss_weight: float = 1e-4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.z_loss_weight = z_loss_weight

    def forward_step(self, batch: dict, chunk):
        # Without labels the last stage returns vocab-parallel logits [batch, seq, vocab / tp]
        # (earlier pipeline stages return hidden states, which loss_fn never sees).
        output = chunk(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)

        def loss_fn(logits: torch.Tensor):
            mask = batch["loss_mask"].float()
            # mcore's cross-entropy works in place on fp32 logits: give it a copy, log Z needs them.
            ce = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), batch["labels"])
            z = vocab_parallel_logsumexp(logits).square()
            ce_sum, z_sum, count = (ce * mask).sum(), (z * mask).sum(), mask.sum()
            total = ce_sum + self.z_loss_weight * z_sum
            metrics = {name: torch.stack([value.detach(), count.detach()])
                       for name, value in (("loss", total), ("ce", ce_sum), ("z_loss", z_sum))}
            return total, count.to(torch.int), metrics

        return output, loss_fn


class DumpFirstStep(L.Callback):
    """The initial weights (as a Hugging Face directory) and the first batch, so that the first
    step's logged loss can be recomputed outside mcore (tests/test_examples.py does)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.save_hf_checkpoint(self.directory / "init")  # collective: every rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and trainer.is_global_zero:
            torch.save({k: v.cpu() for k, v in batch.items()}, self.directory / "first_batch.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--z-loss-weight", type=float, default=1e-4)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2, help="tensor_model_parallel_size")
    parser.add_argument("--out", default="runs/custom_loss", help="CSV logs")
    parser.add_argument("--dump", default=None, help="write the initial weights and first batch here")
    args = parser.parse_args()

    L.seed_everything(1234)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=MegatronStrategy(tensor_model_parallel_size=args.tp, global_batch_size=8, micro_batch_size=4),
        max_steps=args.steps,
        log_every_n_steps=1,
        enable_checkpointing=False,
        logger=CSVLogger(args.out),
        callbacks=[DumpFirstStep(args.dump)] if args.dump else None,
    )
    config = GPTConfig(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                       num_query_groups=2, vocab_size=512, seq_length=128, tie_word_embeddings=True)
    model = ZLossPretrain(config, OptimizerSettings(lr=3e-3, min_lr=3e-4, warmup_steps=5),
                          z_loss_weight=args.z_loss_weight)
    data = PretrainDataModule(paths=str(SAMPLE / "sample.txt"), tokenizer=str(SAMPLE / "tokenizer"),
                              seq_length=128)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        m = trainer.callback_metrics
        print(f"loss {float(m['train/loss']):.3f} = ce {float(m['train/ce']):.3f} + "
              f"{args.z_loss_weight:g} * z_loss {float(m['train/z_loss']):.3f}; metrics in {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
