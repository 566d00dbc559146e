"""Host time per step that Lightning's loop adds around mcore, on CPU (1 process, tiny model).

Times each training step (on_train_batch_start -> on_train_batch_end) and, inside it, the
strategy's forward_backward (mcore's schedule, then gradient norm, clipping and the step's
check) and mcore's optimizer update; what is left is
Lightning's loop, hooks, logging and our wrappers. On GPU that time hides behind queued
kernels unless the host sets the pace (MoE with its per-layer device-to-host syncs).

    OMP_NUM_THREADS=1 python benchmarks/loop_overhead.py [--steps 60] [--throughput]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from toy import TokenRows, tiny_config  # noqa: E402

from lightning_mcore import MegatronStrategy, MegatronThroughput, OptimizerSettings, PretrainModule  # noqa: E402

clock = {"fb": 0.0, "opt": 0.0}


class TimedStrategy(MegatronStrategy):
    def forward_backward(self, *args, **kwargs):
        t = time.perf_counter()
        out = super().forward_backward(*args, **kwargs)
        clock["fb"] += time.perf_counter() - t
        return out

    def megatron_optimizer(self, settings):
        wrapped = super().megatron_optimizer(settings)
        inner_step = wrapped.optimizer.step_with_ready_grads

        def timed_step():
            t = time.perf_counter()
            out = inner_step()
            clock["opt"] += time.perf_counter() - t
            return out

        # mcore's update, which our wrapper calls once the step's check passed (not Lightning's)
        wrapped.optimizer.step_with_ready_grads = timed_step
        return wrapped


class StepClock(L.Callback):
    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float]] = []

    def on_train_batch_start(self, *args) -> None:
        clock.update(fb=0.0, opt=0.0)
        self.t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.rows.append((time.perf_counter() - self.t, clock["fb"], clock["opt"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--throughput", action="store_true", help="add the MegatronThroughput callback")
    args = ap.parse_args()
    step_clock = StepClock()
    callbacks = [step_clock] + ([MegatronThroughput(window_size=10)] if args.throughput else [])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                        strategy=TimedStrategy(global_batch_size=4, micro_batch_size=1),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(PretrainModule(tiny_config(num_layers=1), OptimizerSettings(lr=1e-4)),
                DataLoader(TokenRows(n=4 * (args.steps + 1)), batch_size=4))
    rows = step_clock.rows[args.warmup:]
    mean = [1e3 * sum(r[i] for r in rows) / len(rows) for i in range(3)]
    print(f"per step over {len(rows)} steps: {mean[0]:.2f} ms in all, {mean[1]:.2f} ms mcore schedule and the "
          f"update's check, {mean[2]:.2f} ms mcore optimizer update, {mean[0] - mean[1] - mean[2]:.2f} ms "
          f"Lightning and the rest")


if __name__ == "__main__":
    main()
