"""Acceptance (distillation): each divergence equals trl's generalized_jsd_loss formula computed from
transformers' logits; the vocab-parallel divergence and its gradient equal the gathered one; TP=2
(+SP) and PP=2 equal TP=1; a student learns a teacher's distributions on the bundled chats; a
teacher with another vocabulary or tokenizer is refused before any worker starts."""

import json
import math
import multiprocessing
import shutil
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import make_hf_model
from lightning_mcore import MegatronStrategy, OptimizerSettings
from lightning_mcore.data.packing import build_row
from lightning_mcore.objectives.distill import DistillModule, DistillSettings
from toy import fit, tiny_config

ROOT = Path(__file__).parents[1]
SEQ = 32
METRICS = ("loss", "divergence", "ce")


# ------------------------------------------------------------------ independent reference
def gkd_token_loss(student_logits, teacher_logits, labels, settings: DistillSettings):
    """Per-token loss from full-vocabulary logits, as trl's GKDTrainer.generalized_jsd_loss
    (reduction="none", summed over the vocabulary) mixed with F.cross_entropy."""
    s = F.log_softmax(student_logits / settings.temperature, -1)
    t = F.log_softmax(teacher_logits / settings.temperature, -1)
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(settings.divergence, settings.beta)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(m, t, reduction="none", log_target=True) + (1 - b) * F.kl_div(m, s, reduction="none", log_target=True)
    divergence = jsd.sum(-1)
    ce = F.cross_entropy(student_logits, labels, reduction="none")
    return settings.sft_weight * ce + (1 - settings.sft_weight) * divergence, divergence, ce


# ------------------------------------------------------------------ vocab-parallel unit test
def _vocab_parallel_rank(rank, world, init, out, settings):
    from lightning_mcore.objectives.distill_loss import token_cross_entropy, token_divergence

    try:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        gen = torch.Generator().manual_seed(0)
        vocab, padded, tokens = 13, 16, 6  # rank 1 holds 5 real columns and 3 of padding
        student = torch.randn(tokens, padded, generator=gen) * 3
        teacher = torch.randn(tokens, padded, generator=gen) * 3
        labels = torch.randint(0, vocab, (tokens,), generator=gen)
        weights = torch.rand(tokens, generator=gen)
        width = padded // world
        mine = student[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
        theirs = teacher[:, rank * width:(rank + 1) * width]
        div = token_divergence(mine, theirs, vocab, None, settings.divergence, settings.beta, settings.temperature)
        ce = token_cross_entropy(mine, labels, vocab, None)
        loss = settings.sft_weight * ce + (1 - settings.sft_weight) * div
        (loss * weights).sum().backward()

        full = student[:, :vocab].clone().requires_grad_(True)
        want, want_div, want_ce = gkd_token_loss(full, teacher[:, :vocab], labels, settings)
        (want * weights).sum().backward()
        grad = torch.zeros(tokens, padded)
        grad[:, :vocab] = full.grad
        errors = [float((div - want_div).abs().max()), float((ce - want_ce).abs().max()),
                  float((mine.grad - grad[:, rank * width:(rank + 1) * width]).abs().max())]
        Path(f"{out}.{rank}").write_text(json.dumps(errors))
    except Exception:  # noqa: BLE001 - reported to the test
        Path(f"{out}.{rank}").write_text(json.dumps({"error": traceback.format_exc()}))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


SETTINGS = {
    "forward_kl": DistillSettings(divergence="forward_kl"),
    "reverse_kl_T2": DistillSettings(divergence="reverse_kl", temperature=2.0),
    "jsd_mixed": DistillSettings(divergence="jsd", beta=0.5, temperature=0.7, sft_weight=0.3),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_vocab_parallel_divergence_and_gradient_equal_gathered(tmp_path, name):
    ctx = multiprocessing.get_context("fork")
    init, out = f"file://{tmp_path / 'init'}", tmp_path / "errors"
    procs = [ctx.Process(target=_vocab_parallel_rank, args=(r, 2, init, out, SETTINGS[name])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for rank in range(2):
        errors = json.loads(Path(f"{out}.{rank}").read_text())
        assert isinstance(errors, list), errors
        assert max(errors) <= 1e-5, (rank, errors)  # divergence, cross-entropy, gradient
