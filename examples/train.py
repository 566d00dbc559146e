"""Pretrain a tiny Llama with tensor parallelism from a plain Python script (no YAML).

    python examples/train.py                                       # 2 CPU processes, TP=2
    python examples/train.py --accelerator gpu --devices 8 --tp 2 --steps 500 --precision bf16-mixed

Lightning starts the other ranks by re-running this script (hence the __main__ guard). The loss
goes to OUT/lightning_logs/version_N/metrics.csv (`train/loss`) and the trained model to
OUT/hf/step=STEPS as a Hugging Face directory (transformers' AutoModelForCausalLM loads it).
"""

import argparse
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lightning_mcore import (
    GPTConfig,
    HFExport,
    MegatronStrategy,
    OptimizerSettings,
    PretrainModule,
)
from lightning_mcore.data import PretrainDataModule

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "configs" / "sample_data"


def tiny_llama(seq_length: int = 128) -> GPTConfig:
    """2 layers, hidden 128, GQA (4 heads, 2 query groups), tied embeddings: configs/quickstart.yaml's model."""
    return GPTConfig(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                     num_query_groups=2, vocab_size=512, seq_length=seq_length, tie_word_embeddings=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps")
    parser.add_argument("--accelerator", default="cpu", help="cpu, gpu or auto")
    parser.add_argument("--devices", type=int, default=2, help="processes (GPUs) on this node")
    parser.add_argument("--tp", type=int, default=2, help="tensor_model_parallel_size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="runs/train_example", help="logs and the HF export")
    args = parser.parse_args()

    L.seed_everything(1234)
    strategy = MegatronStrategy(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        log_every_n_steps=1,
        enable_checkpointing=False,
        logger=CSVLogger(args.out),
        callbacks=[HFExport(f"{args.out}/hf")],  # at the end of training: OUT/hf/step=STEPS
    )
    model = PretrainModule(tiny_llama(), OptimizerSettings(lr=args.lr, min_lr=args.lr / 10, warmup_steps=5))
    data = PretrainDataModule(paths=str(SAMPLE / "sample.txt"), tokenizer=str(SAMPLE / "tokenizer"),
                              seq_length=128)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print(f"loss {float(trainer.callback_metrics['train/loss']):.3f}; "
              f"metrics in {trainer.logger.log_dir}; Hugging Face model in {args.out}/hf/step={trainer.global_step}")


if __name__ == "__main__":
    main()
