"""Acceptance: a tiny model memorises a few sentences (loss below 0.1), under tensor parallelism."""

from pathlib import Path

import torch
from transformers import AutoTokenizer

from lightning_mcore import OptimizerSettings
from toy import TokenRows, fit, tiny_config

TOKENIZER = Path(__file__).parents[1] / "configs" / "sample_data" / "tokenizer"
SENTENCES = [
    "The lighthouse keeper counted ships until the fog rolled in.",
    "A small garden of mint grew behind the old bakery.",
    "Every morning the river carried leaves toward the sea.",
    "She packed three apples and a map for the mountain walk.",
]


def test_tiny_model_memorises_sentences(tmp_path):
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    seq = 48
    rows, masks = [], []
    for text in SENTENCES:
        ids = [tok.bos_token_id] + tok(text)["input_ids"] + [tok.eos_token_id]
        assert len(ids) <= seq + 1, "sentence longer than the test sequence"
        mask = torch.zeros(seq)
        mask[: len(ids) - 1] = 1.0  # labels past the end of the sentence are padding
        rows.append(torch.tensor(ids + [tok.pad_token_id] * (seq + 1 - len(ids))))
        masks.append(mask)

    class Sentences(TokenRows):
        def __getitem__(self, i):
            item = super().__getitem__(i % len(SENTENCES))
            item["loss_mask"] = masks[i % len(SENTENCES)]
            return item

        def __len__(self):
            return 4 * len(SENTENCES)

    config = tiny_config(num_layers=2, vocab_size=len(tok), seq_length=seq)
    losses = fit(tmp_path, devices=2, steps=60, gbs=4, mbs=2, config=config,
                 optim=OptimizerSettings(lr=1e-2, weight_decay=0.0, warmup_steps=5, decay_style="constant"),
                 dataset=Sentences(rows=torch.stack(rows)), tensor_model_parallel_size=2)
    assert losses[0] > 4.0  # started from chance level (log 512 = 6.2)
    assert losses[-1] < 0.1, losses[-10:]
