"""Rebuild the tiny byte-level BPE tokenizer bundled next to this script.

Trained on sample.txt so tests and examples run offline with a vocabulary small
enough that a toy model learns it in a few dozen steps.

    python configs/sample_data/make_tokenizer.py
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
VOCAB_SIZE = 512


def build(text_file: Path = HERE / "sample.txt", out_dir: Path = HERE / "tokenizer") -> None:
    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(text_file)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL).save_pretrained(str(out_dir))
    # Written by hand so transformers 4.x and 5.x read the same class and tokens.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({**config, **SPECIAL}, indent=2) + "\n"
    )
    (out_dir / "special_tokens_map.json").write_text(json.dumps(SPECIAL, indent=2) + "\n")


if __name__ == "__main__":
    build()
