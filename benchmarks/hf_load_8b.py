"""Load a random Llama-3-8B-shaped HF checkpoint into TP=2 and export it back, timed.

    python benchmarks/hf_load_8b.py make --out /tmp/llama8b          # once: write the checkpoint
    torchrun --standalone --nproc-per-node 2 benchmarks/hf_load_8b.py run --src /tmp/llama8b

`make` draws bf16 weights on the GPU for every tensor of LlamaForCausalLM (names and shapes
from a meta-device model) and writes 5 GB safetensors shards with an index. `run` builds the
mcore model with TP=2 (Transformer Engine spec, bf16) from it, runs one forward, exports it,
and checks a sample of exported tensors against the source bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

CONFIG = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
              rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})


def make(out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**CONFIG, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    shard, files, weight_map, size = {}, [], {}, 0
    names = list(shapes)

    def flush():
        nonlocal shard, size
        name = f"part-{len(files)}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append((name, list(shard)))
        shard, size = {}, 0

    for n in names:
        t = torch.randn(shapes[n], generator=gen, device="cuda", dtype=torch.float32)
        t = (t * (0.02 if t.dim() > 1 else 1.0) + (1.0 if "norm" in n else 0.0)).to(torch.bfloat16)
        shard[n] = t.cpu()
        size += t.numel() * 2
        if size >= 5 * 2**30:
            flush()
    flush()
    total = sum(p.numel() for p in shapes.values())
    for i, (tmp, keys) in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        os.replace(out / tmp, out / final)
        weight_map.update({k: final for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": weight_map}))
    config.save_pretrained(out)
    print(f"MADE {total / 1e9:.2f}B params in {time.perf_counter() - t0:.1f} s", flush=True)


def run(src: Path, export_to: Path) -> None:
    import lightning as L
    from safetensors import safe_open
    from torch.utils.data import DataLoader

    from lightning_mcore import MegatronStrategy, PretrainModule

    timings = {}

    class Timed(PretrainModule):
        def configure_model(self):
            torch.cuda.synchronize()
            t = time.perf_counter()
            super().configure_model()
            torch.cuda.synchronize()
            timings["load_s"] = time.perf_counter() - t

    class Report(L.Callback):
        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            timings["logits_finite"] = bool(torch.isfinite(outputs).all())
            timings["logits_shape"] = list(outputs.shape)

        def on_predict_end(self, trainer, pl_module):
            t = time.perf_counter()
            pl_module.save_hf_checkpoint(export_to)
            timings["export_s"] = time.perf_counter() - t

    world = int(os.environ.get("WORLD_SIZE", 1))
    strategy = MegatronStrategy(tensor_model_parallel_size=world, global_batch_size=1)
    trainer = L.Trainer(accelerator="gpu", devices=world, strategy=strategy, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Report()])
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    trainer.predict(Timed(str(src)), DataLoader([{"tokens": tokens[0]}], batch_size=1))
    timings["predict_total_s"] = time.perf_counter() - t
    if trainer.global_rank == 0:
        index = json.loads((export_to / "model.safetensors.index.json").read_text())["weight_map"]
        src_index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        sample = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.7.self_attn.k_proj.weight",
                  "model.layers.31.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight"]
        same = []
        for name in sample:
            with safe_open(src / src_index[name], "pt") as a, safe_open(export_to / index[name], "pt") as b:
                same.append(torch.equal(a.get_tensor(name), b.get_tensor(name)))
        timings.update(bit_identical_sample=all(same), exported_tensors=len(index),
                       source_tensors=len(src_index), tp=world, device=torch.cuda.get_device_name())
        print("RESULT " + json.dumps(timings), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["make", "run"])
    ap.add_argument("--out", type=Path, default=Path("/tmp/llama8b"))
    ap.add_argument("--src", type=Path, default=Path("/tmp/llama8b"))
    ap.add_argument("--export", type=Path, default=Path("/tmp/llama8b-export"))
    args = ap.parse_args()
    make(args.out) if args.cmd == "make" else run(args.src, args.export)


if __name__ == "__main__":
    main()
