"""Rebuild tiny-llama/, the small pretrained Llama bundled next to this script.

The quickstart recipe (configs/quickstart.yaml: 2 layers, hidden 128, GQA, tied embeddings, 80
steps on sample.txt, 2 CPU processes at TP=2, seed 1234) at seq_length 256 so that the bundled
chats fit (and 10% of the text held out instead of 5%: one global batch of the longer windows),
exported with `lightning-mcore export`; then the bundled tokenizer with a ChatML chat template,
and the tokenizer's special token ids in config.json. configs/sft.yaml, sft_lora.yaml
and dpo.yaml fine-tune it, so what they write loads in transformers and peft like a Hub model.
About a minute on 2 CPU cores:

    python configs/sample_data/make_tiny_base.py [--overwrite]

The seeds are fixed: on one machine and software stack the weights come out the same; elsewhere
they may differ in the last bits.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE / "tiny-llama"
SEQ_LENGTH = 256


def cli(cwd: Path, *args: str) -> None:
    """`lightning-mcore ARGS` with this checkout's package, in `cwd`."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, "-m", "lightning_mcore.cli", *args], cwd=cwd, env=env, check=True)


def build(out: Path = OUT, overwrite: bool = False) -> Path:
    sys.path.insert(0, str(ROOT))
    from lightning_mcore.atomic import replace_dir
    from lightning_mcore.data.chat import CHATML

    if out.exists() and not overwrite:
        raise SystemExit(f"{out} exists: pass --overwrite to rebuild it")
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        (work / "configs").symlink_to(ROOT / "configs")  # the recipe's relative data paths
        cli(work, "fit", "--config", "configs/quickstart.yaml",
            "--model.init_args.model.seq_length", str(SEQ_LENGTH),
            "--data.init_args.seq_length", str(SEQ_LENGTH),
            "--data.init_args.val_split", "0.1")  # 8 of the ~80 longer windows: one global batch
        cli(work, "export", "--checkpoint", "runs/quickstart/checkpoints/last.ckpt", "--output", "hf")

        staged = out.parent / f".{out.name}.tmp-{os.getpid()}"
        staged.mkdir()
        for name in ("tokenizer.json", "special_tokens_map.json"):
            shutil.copyfile(HERE / "tokenizer" / name, staged / name)
        tokenizer_config = json.loads((HERE / "tokenizer" / "tokenizer_config.json").read_text())
        tokenizer_config.update(chat_template=CHATML, model_max_length=SEQ_LENGTH)
        (staged / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(staged)
        config = json.loads((work / "hf" / "config.json").read_text())
        config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
        (staged / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for weights in (work / "hf").glob("*.safetensors*"):
            shutil.copyfile(weights, staged / weights.name)  # mode from the umask, not the export's
        replace_dir(staged, out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tiny-llama/")
    print(build(overwrite=parser.parse_args().overwrite))
