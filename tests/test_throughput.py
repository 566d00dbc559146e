"""Model FLOPs against torch's FLOP counter on transformers' own models; the MegatronThroughput
callback's logged rates against step-end timestamps; loggers fed from the last pipeline stage."""

import csv
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from lightning_mcore import MegatronStrategy, MegatronThroughput, OptimizerSettings, PretrainModule
from lightning_mcore.models import gpt_config_from_hf
from lightning_mcore.model.flops import training_flops_per_token
from toy import TokenRows, fit, tiny_config


def counted_training_flops(model, seq: int) -> float:
    """FLOPs torch counts for one forward + backward of a [1, seq] batch, per token, less the
    RoPE frequency table (positions x inverse frequencies: a matmul in some transformers
    versions, e.g. 5.17, an elementwise product in others; not model compute)."""
    tokens = torch.randint(0, model.config.vocab_size, (1, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens, labels=tokens).loss.backward()
    rope = sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items()
               if name.endswith("rotary_emb"))
    return (counter.get_total_flops() - rope) / seq


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_flops_per_token_equal_torch_flop_counter(family, tmp_path):
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=False)
    if family == "llama":  # GQA (8 heads, 2 groups), head_dim 16 != hidden / heads
        hf_config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    else:  # 8 experts, top-2, every layer sparse
        hf_config = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                                moe_intermediate_size=48, decoder_sparse_step=1,
                                                mlp_only_layers=[])
        model_cls = transformers.Qwen3MoeForCausalLM
    hf_config._attn_implementation = "eager"  # explicit matmuls over the full s x s scores
    hf_config._experts_implementation = "eager"  # a loop of per-expert linears on routed tokens
    hf_config.save_pretrained(tmp_path)
    cfg, _ = gpt_config_from_hf(tmp_path)
    torch.manual_seed(0)
    model = model_cls(hf_config).float()
    seq = 24
    expected = counted_training_flops(model, seq)
    assert training_flops_per_token(cfg, seq) == pytest.approx(expected, rel=1e-9)
    assert training_flops_per_token(cfg, seq, frozen_base=True) == pytest.approx(2 * expected / 3, rel=1e-9)


class StepEnds(L.Callback):
    """Wall-clock stamps of the start of training and of each batch end (just before
    MegatronThroughput takes its own): stamps[k] is the end of the k-th batch."""

    def __init__(self):
        self.stamps = []

    def on_train_start(self, trainer, *args):
        self.stamps.append(time.perf_counter())

    def on_train_batch_end(self, trainer, *args):
        self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save(self.stamps, trainer.default_root_dir + "/stamps.pt")


@pytest.mark.distributed
def test_logged_throughput_and_mfu_follow_step_times_from_the_last_stage(tmp_path):
    cfg = tiny_config()
    gbs, window, steps, peak = 8, 3, 6, 1e-3  # a tiny peak so MFU is logged on CPU
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, default_root_dir=str(tmp_path),
        strategy=MegatronStrategy(pipeline_model_parallel_size=2, global_batch_size=gbs,
                                  micro_batch_size=2, start_method="fork"),
        logger=[CSVLogger(tmp_path), TensorBoardLogger(tmp_path / "tb")], log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepEnds(), MegatronThroughput(window_size=window, peak_tflops=peak)],
    )
    trainer.fit(PretrainModule(cfg, OptimizerSettings(lr=1e-3)),
                DataLoader(TokenRows(seq=cfg.seq_length, vocab=cfg.vocab_size), batch_size=gbs))
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    stamps = torch.load(tmp_path / "stamps.pt")

    perf = [r for r in rows if r.get("perf/tokens_per_sec_per_gpu")]
    # from the first window's end on (Lightning logs the last value again at the steps between)
    assert [int(r["step"]) for r in perf] == list(range(window - 1, steps))
    flops_per_token = training_flops_per_token(cfg, cfg.seq_length)
    for r in perf:
        end = (int(r["step"]) + 1) // window * window  # the last window's last batch (step counts from 0)
        seconds = stamps[end] - stamps[end - window]
        tokens_per_gpu = gbs * cfg.seq_length * window / seconds / 2
        assert float(r["perf/tokens_per_sec_per_gpu"]) == pytest.approx(tokens_per_gpu, rel=0.02)
        tflops = float(r["perf/tokens_per_sec_per_gpu"]) * flops_per_token / 1e12
        assert float(r["perf/tflops_per_gpu"]) == pytest.approx(tflops, rel=1e-6)
        assert float(r["perf/mfu"]) == pytest.approx(100 * tflops / peak, rel=1e-6)

    # rank 0 is pipeline stage 0; the loss it logs is the last stage's, equal to a 1-process run
    logged = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    reference = fit(tmp_path, devices=1, steps=steps, gbs=gbs, config=cfg, name="single")
    assert logged == pytest.approx(reference, abs=1e-5)

    # TensorBoard gets the same values as the CSV logger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent)).Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)
    assert [e.value for e in events.Scalars("perf/mfu")] == pytest.approx(
        [float(r["perf/mfu"]) for r in perf], rel=1e-6)


def test_batches_without_token_rows_are_skipped():
    """GRPO's batches hold prompts (lists), not token rows: the callback counts nothing for them
    instead of failing on a missing shape."""
    callback = MegatronThroughput(window_size=2)
    batch = {"prompt": ["a question"], "prompt_ids": [[1, 2, 3]], "answer": ["4"]}
    assert callback.on_train_batch_end(None, None, None, batch, 0) is None
