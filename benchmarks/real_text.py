"""Real text without downloads: Python sources on this machine, for loss curves (FP8 vs bf16).

build() collects every *.py file under sysconfig's stdlib directory (site-/dist-packages excluded)
and under the installed packages named in `packages` (e.g. torch: 46 MB of sources), trains a byte-level BPE tokenizer on them (HF `tokenizers`, Rust threads on all cores), encodes every
file with <|endoftext|> after it, and writes into out_dir:
    tokens.npy      one flat token stream (uint16 when the vocab fits, else uint32) (np.load(..., mmap_mode="r"))
    tokenizer.json  the trained tokenizer (tokenizers.Tokenizer.from_file)
    meta.json       counts and settings; a later build() with the same settings reuses the files
File order is sorted, then shuffled with a fixed seed, so the held-out tail (TokenWindows(split="eval"))
is a random sample of whole files that training never sees.

    python benchmarks/real_text.py --out /tmp/stdlib_tokens --vocab 32768 [--packages torch] [--max-files N]

TokenWindows yields bench_pretrain.RandomTokens' dict (tokens, labels, loss_mask, position_ids; [seq]
each) from non-overlapping windows of seq + 1 tokens, in a fixed shuffled order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

EOS = "<|endoftext|>"


def source_files(packages: tuple[str, ...] = (), max_files: int | None = None, seed: int = 0) -> list[Path]:
    """The stdlib's *.py files plus those of the named installed packages, in a seeded order."""
    import importlib.util

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--packages: {name!r} is not an installed package on this machine")
        files += sorted(Path(spec.submodule_search_locations[0]).rglob("*.py"))
    random.Random(seed).shuffle(files)
    return files[:max_files]


def build(out_dir, vocab_size: int = 32768, seq: int = 4096, max_files: int | None = None,
          force: bool = False, packages: tuple[str, ...] = ()) -> str:
    """Writes tokens.npy, tokenizer.json and meta.json into out_dir (reused when already built with
    the same settings unless force); prints the counts; returns the path of tokens.npy."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0],
                "vocab_size": vocab_size, "max_files": max_files, "packages": list(packages)}
    meta_path, tokens_path = out / "meta.json", out / "tokens.npy"
    if not force and meta_path.exists() and tokens_path.exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in settings.items()):
            _report(meta, seq, reused=True)
            return str(tokens_path)

    t0 = time.perf_counter()
    texts, skipped = [], 0
    for path in source_files(packages, max_files):
        try:
            texts.append(path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            skipped += 1
    t_read = time.perf_counter()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.save(str(out / "tokenizer.json"))
    t_train = time.perf_counter()

    eos = tok.token_to_id(EOS)
    dtype = np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast (tokenizers >= 0.21): no offsets
    chunks = []
    for i in range(0, len(texts), 256):  # bounded memory: Encoding objects are large
        for enc in encode(texts[i:i + 256], add_special_tokens=False):
            chunks.append(np.asarray(enc.ids + [eos], dtype=dtype))
    tokens = np.concatenate(chunks)
    np.save(tokens_path, tokens)
    t_end = time.perf_counter()

    meta = {**settings, "files": len(texts), "skipped": skipped, "bytes": sum(len(t.encode()) for t in texts),
            "tokens": int(tokens.size), "eos_id": eos, "vocab_trained": tok.get_vocab_size(), "dtype": np.dtype(dtype).name,
            "seconds": {"read": round(t_read - t0, 1), "train_tokenizer": round(t_train - t_read, 1),
                        "encode": round(t_end - t_train, 1), "total": round(t_end - t0, 1)},
            "threads": os.cpu_count()}
    meta_path.write_text(json.dumps(meta, indent=1))
    _report(meta, seq, reused=False)
    return str(tokens_path)


def _report(meta: dict, seq: int, reused: bool) -> None:
    windows = meta["tokens"] // (seq + 1)
    held = _eval_windows(windows)
    print(f"python sources (stdlib {meta['python']} + {meta.get('packages') or 'no packages'}{', reused' if reused else ''}): {meta['files']} files "
          f"({meta['skipped']} skipped), {meta['bytes'] / 1e6:.1f} MB, {meta['tokens'] / 1e6:.2f} M tokens "
          f"({meta['bytes'] / meta['tokens']:.2f} bytes/token, vocab {meta['vocab_trained']}), "
          f"seq {seq}: {windows - held} train + {held} eval windows; seconds {meta['seconds']}", flush=True)


def _eval_windows(windows: int, eval_frac: float = 0.02) -> int:
    return min(windows - 1, max(1, round(windows * eval_frac))) if windows > 1 else 0


class TokenWindows(Dataset):
    """Window i covers tokens[i*(seq+1) : (i+1)*(seq+1)]. split="train": all windows but the last
    eval_frac, permuted by `seed`; split="eval": the last eval_frac, in file order. `path`: build()'s
    tokens.npy or its directory; `vocab_size`: the trained vocabulary (from meta.json)."""

    def __init__(self, path, seq: int, split: str = "train", eval_frac: float = 0.02, seed: int = 1234) -> None:
        path = Path(path) / "tokens.npy" if Path(path).is_dir() else Path(path)
        self.path, self.seq = str(path), seq
        meta = path.with_name("meta.json")
        self.vocab_size = json.loads(meta.read_text())["vocab_trained"] if meta.exists() else None
        windows = len(np.load(self.path, mmap_mode="r")) // (seq + 1)
        n_eval = _eval_windows(windows, eval_frac)
        if split == "train":
            self.index = np.random.default_rng(seed).permutation(windows - n_eval)
        elif split == "eval":
            self.index = np.arange(windows - n_eval, windows)
        else:
            raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        self._tokens = None  # opened lazily, so DataLoader workers each map the file themselves

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        if self._tokens is None:
            self._tokens = np.load(self.path, mmap_mode="r")
        start = int(self.index[i]) * (self.seq + 1)
        row = torch.from_numpy(self._tokens[start:start + self.seq + 1].astype(np.int64))
        return {"tokens": row[:-1], "labels": row[1:], "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq)}

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/stdlib_tokens")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--packages", nargs="*", default=[], help="installed packages whose sources join the stdlib's")
    ap.add_argument("--force", action="store_true", help="rebuild even if out already holds this build")
    args = ap.parse_args()
    path = build(args.out, args.vocab, args.seq, args.max_files, args.force, tuple(args.packages))
    ds = TokenWindows(path, args.seq)
    if len(ds):
        from tokenizers import Tokenizer

        text = Tokenizer.from_file(str(Path(path).parent / "tokenizer.json")).decode(ds[0]["tokens"][:48].tolist())
        print(f"{path}: first train window starts {text!r}")


if __name__ == "__main__":
    main()
