"""Issue 21 (GPU): under Trainer(deterministic=True) decode steps over more than 128 cached keys are
bitwise reproducible. TE's fused attention was not (generation/reproducible_attention.py): the same
teacher-forced decoding pass twice gives bitwise-equal logits at every step, decode steps select
TE's unfused attention and training steps its fused one again."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mcore import MegatronStrategy, OptimizerSettings, PretrainModule
from lightning_mcore.generation.kv_cache import next_token_logits
from toy import TokenRows, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, PROMPT, STEPS = 32, 140, 24  # every decode step attends over more than 128 keys


def teacher_forced(module, tokens: torch.Tensor, graphs: bool) -> list:
    strategy, chunks, cfg = module._strategy(), list(module.chunks), module.model_config
    out = []
    with torch.no_grad(), next_token_logits(strategy, chunks, cfg, ROWS, PROMPT + STEPS, graphs) as forward:
        out.append(forward(tokens[:, :PROMPT]).clone())
        for s in range(STEPS):
            out.append(forward(tokens[:, PROMPT + s:PROMPT + s + 1]).clone())
    return out


class TwoPasses(L.Callback):
    def __init__(self) -> None:
        self.got = {}

    def on_train_start(self, trainer, module):
        from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, module.model_config.vocab_size, (ROWS, PROMPT + STEPS), generator=gen)
        for graphs in (True, False):  # eager last: its last call selected a decode step's backend
            first, second = teacher_forced(module, tokens, graphs), teacher_forced(module, tokens, graphs)
            self.got[graphs] = [torch.equal(a, b) for a, b in zip(first, second)]
        self.got["decode_unfused"] = bool(dpa._attention_backends["use_unfused_attention"])

    def on_train_batch_end(self, trainer, module, *args):
        from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

        self.got["train_fused"] = bool(dpa._attention_backends["use_fused_attention"])


def test_decode_steps_bitwise_reproducible_when_deterministic():
    record = TwoPasses()
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", deterministic=True, max_steps=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[record],
                            strategy=MegatronStrategy(global_batch_size=2, micro_batch_size=2, start_method="popen"))
        config = tiny_config(num_layers=2, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8,
                             num_query_groups=2, vocab_size=2000, seq_length=256, transformer_impl="transformer_engine")
        trainer.fit(PretrainModule(config, OptimizerSettings(lr=1e-4)),
                    DataLoader(TokenRows(n=2, seq=256, vocab=2000), batch_size=2))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for graphs in (False, True):
        assert len(record.got[graphs]) == STEPS + 1 and all(record.got[graphs]), (graphs, record.got[graphs])
    assert record.got["decode_unfused"] and record.got["train_fused"], record.got
