"""Acceptance (SFT): a tiny model fine-tuned at TP=2 on 8 conversations drives the loss on
assistant tokens below 0.05, and greedy decoding with the mcore model reproduces the replies."""

import json
from pathlib import Path

import lightning as L
import pytest

from lightning_mcore import GPTConfig, MegatronStrategy, OptimizerSettings
from lightning_mcore.data import SFTDataModule
from lightning_mcore.data.chat import CHATML
from lightning_mcore.objectives.sft import SFTModule
from toy import RecordLosses

ROOT = Path(__file__).parents[1]
TOKENIZER = ROOT / "configs/sample_data/tokenizer"


class GreedyReplies(L.Callback):
    """At the end, every rank decodes each conversation's last reply from its prompt."""

    def __init__(self, cases, out: Path) -> None:
        self.cases, self.out = cases, out

    def on_train_end(self, trainer, pl_module):
        got = [pl_module.generate(prompt, len(reply)) for prompt, reply in self.cases]
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(got))


@pytest.mark.distributed
def test_sft_overfits_and_greedy_decoding_reproduces_replies(tmp_path):
    from transformers import AutoTokenizer

    conversations = (ROOT / "configs/sample_data/sft.jsonl").read_text().splitlines()[:8]
    (tmp_path / "chats.jsonl").write_text("\n".join(conversations) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    cases = []  # (prompt ids, expected reply ids) from the template, independently of our code
    for line in conversations[:2] + conversations[2:3]:
        messages = json.loads(line)["messages"]
        prompt = tokenizer.apply_chat_template(messages[:-1], chat_template=CHATML, tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
        full = tokenizer.apply_chat_template(messages, chat_template=CHATML, tokenize=True,
                                             return_dict=False)
        assert full[: len(prompt)] == prompt
        cases.append((prompt, full[len(prompt):]))

    config = GPTConfig(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                       num_query_groups=2, vocab_size=512, seq_length=256, transformer_impl="local")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=60, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RecordLosses(tmp_path / "losses.json"), GreedyReplies(cases, tmp_path / "greedy.json")],
        strategy=MegatronStrategy(tensor_model_parallel_size=2, global_batch_size=8, micro_batch_size=4,
                                  start_method="fork"),
    )
    data = SFTDataModule(str(tmp_path / "chats.jsonl"), str(TOKENIZER), 256, chat_template="chatml",
                         packing=False, cache_dir=str(tmp_path / "cache"))
    trainer.fit(SFTModule(config, OptimizerSettings(lr=3e-3, warmup_steps=5, min_lr=3e-4)), data)

    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses[0] > 3 and losses[-1] < 0.05, losses[::10]
    greedy = json.loads((tmp_path / "greedy.json").read_text())
    for (prompt, reply), got in zip(cases, greedy):
        assert got == reply, (tokenizer.decode(got), tokenizer.decode(reply))
