"""benchmarks/hf_fsdp2.py with MaskedRows as its data: one rank of test_hf_fsdp2_baseline, in an
interpreter of its own (RANK, WORLD_SIZE, MASTER_ADDR from the environment). A rank forked
from the pytest worker crashed (SIGSEGV, nothing printed) in one CI run out of several, after
whatever else that worker had run; a fresh interpreter inherits nothing. It runs the test's
configurations one after another (each hf_fsdp2.main a process group of its own, on its own
port), so that the ranks' ~9 s of imports are paid once, not once per configuration."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the scripts import each other
import bench_pretrain  # noqa: E402
import hf_fsdp2  # noqa: E402

THEN = "--then"


class MaskedRows(bench_pretrain.RandomTokens):
    """bench_pretrain's rows with about 40% of the tokens out of the loss, so that ranks and micro
    batches count different tokens: only the global batch's count gives the full-batch loss."""

    def __getitem__(self, i: int):
        row = super().__getitem__(i)
        row["loss_mask"] = (torch.rand(self.seq, generator=torch.Generator().manual_seed(10_000 + i)) > 0.4).float()
        return row


def runs(argv: list[str]) -> list[tuple[str, list[str]]]:
    """`PORT ARGS... [--then PORT ARGS...]`: each run's rendezvous port and hf_fsdp2's arguments."""
    groups, group = [], []
    for arg in [*argv, THEN]:
        if arg == THEN:
            groups.append((group[0], group[1:]))
            group = []
        else:
            group.append(arg)
    return groups


if __name__ == "__main__":
    hf_fsdp2.RandomTokens = MaskedRows
    for port, args in runs(sys.argv[1:]):
        os.environ["MASTER_PORT"] = port
        hf_fsdp2.main(args)
