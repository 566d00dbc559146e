"""Acceptance (issue 17, items 5-6): bad inputs and damaged files are refused, never run.

Each probe asserts the exit code, one `error:` line naming the problem and the key or file,
no traceback, and that nothing the user had was deleted or half-written (every file under the
test's directory is unchanged, nothing new appeared). Mistakes the launching process can see end
with exit code 2 before any worker starts: those probes call the CLI in-process, with
Trainer.fit forbidden. What only a worker can find (a damaged checkpoint shard, a text shorter
than one sequence) ends with one line from rank 0 and exit code 1: a handful of real launches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
import transformers
import yaml
from torch.utils.data import DataLoader

import forked_process
from hf_models import hf_logits
from lightning_mcore import GPTConfig, MegatronStrategy, PretrainModule
from lightning_mcore.cli import main
from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.models import gpt_config_from_hf
from lightning_mcore.strategy.parallel import LayoutError, ParallelConfig, validate_layout
from toy import tiny_config

ROOT = Path(__file__).parents[1]
SAMPLES = ROOT / "configs" / "sample_data"
TOKENIZER = str(SAMPLES / "tokenizer")

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             num_query_groups=2, vocab_size=512, seq_length=32, transformer_impl="local")
PRETRAIN_DATA = {"class_path": "lightning_mcore.data.PretrainDataModule",
                 "init_args": {"paths": str(SAMPLES / "sample.txt"), "tokenizer": TOKENIZER,
                               "seq_length": 32}}
SFT_DATA = {"class_path": "lightning_mcore.data.SFTDataModule",
            "init_args": {"paths": str(SAMPLES / "sft.jsonl"), "tokenizer": TOKENIZER,
                          "seq_length": 32, "chat_template": "chatml"}}
DPO_DATA = {"class_path": "lightning_mcore.data.DPODataModule",
            "init_args": {"paths": str(SAMPLES / "dpo.jsonl"), "tokenizer": TOKENIZER,
                          "seq_length": 32, "chat_template": "chatml"}}


def write_config(directory: Path, data: dict = PRETRAIN_DATA, module: str = "PretrainModule",
                 model=None, **model_args) -> str:
    """A tiny 2-process TP=2 run on the bundled samples, checkpoints under `directory/run`."""
    data = json.loads(json.dumps(data))
    data["init_args"]["cache_dir"] = str(directory / "cache")
    config = {
        "trainer": {
            "accelerator": "cpu", "devices": 2, "max_steps": 2, "precision": "32-true",
            "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
            "num_sanity_val_steps": 0, "default_root_dir": str(directory / "logs"),
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(directory / "run"), "save_last": True}}],
            "strategy": {"class_path": "lightning_mcore.MegatronStrategy",
                         "init_args": {"tensor_model_parallel_size": 2, "global_batch_size": 4,
                                       "micro_batch_size": 2}},
        },
        "model": {"class_path": f"lightning_mcore.{module}",
                  "init_args": {"model": MODEL if model is None else model, **model_args}},
        "data": data,
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def snapshot(directory: Path) -> dict:
    """Every file under `directory` with a digest of its content."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def error_line(err: str) -> str:
    """The one `error:` line of stderr, which must be its last line, after no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    assert lines[-1] == errors[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return errors[0]


@pytest.fixture(autouse=True)
def no_fit(monkeypatch):
    """Nothing in-process may start training: a missed refusal would launch ranks. A command that
    `launch` forks from this process trains, as it would in a fresh interpreter."""
    fit, test_process = L.Trainer.fit, os.getpid()

    @functools.wraps(L.Trainer.fit)  # the CLI reads fit's arguments (ckpt_path) from its signature
    def refuse(*args, **kwargs):
        if os.getpid() != test_process:
            return fit(*args, **kwargs)
        raise AssertionError("Trainer.fit must not run: the mistake was not found before launch")

    monkeypatch.setattr(L.Trainer, "fit", refuse)


def refused(capsys, tmp_path: Path, config: str, *args: str) -> str:
    """`lightning-mcore fit --config CONFIG ARGS` in-process: exit code 2, one error line
    (returned), and every file under tmp_path as it was."""
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    line = error_line(err)
    assert snapshot(tmp_path) == before, "a refused run changed files"
    return line


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sft_records() -> list:
    return [json.loads(line) for line in (SAMPLES / "sft.jsonl").read_text().splitlines()]


# --------------------------------------------------------------- rows and the model's length
def test_pretrain_rows_longer_than_the_model(capsys, tmp_path):
    line = refused(capsys, tmp_path, write_config(tmp_path), "--data.init_args.seq_length", "64")
    assert "data.init_args.seq_length=64 is longer than the model's seq_length" in line
    assert "model.init_args.model.seq_length=32" in line


def test_sft_rows_longer_than_the_model(capsys, tmp_path):
    line = refused(capsys, tmp_path, write_config(tmp_path, SFT_DATA, "SFTModule"),
                   "--data.init_args.seq_length", "48")
    assert "data.init_args.seq_length=48" in line and "model.init_args.model.seq_length=32" in line


def test_dpo_rows_longer_than_the_model_override(capsys, tmp_path):
    config = write_config(tmp_path, DPO_DATA, "DPOModule", model_overrides={"seq_length": 16})
    line = refused(capsys, tmp_path, config)
    assert "data.init_args.seq_length=32" in line
    assert "model.init_args.model_overrides.seq_length=16" in line


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    """A tiny random HF Llama (max_position_embeddings=256, vocab 512) with the bundled tokenizer."""
    directory = tmp_path_factory.mktemp("hf") / "llama"
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    for file in Path(TOKENIZER).iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def copy_of(source: Path, directory: Path) -> Path:
    shutil.copytree(source, directory)
    return directory


def test_seq_length_beyond_max_position_embeddings(capsys, tmp_path, hf_llama):
    hf = copy_of(hf_llama, tmp_path / "hf")
    config = write_config(tmp_path, model=str(hf), model_overrides={"seq_length": 512})
    line = refused(capsys, tmp_path, config)
    assert "max_position_embeddings=256" in line and "seq_length=512" in line
    assert str(hf / "config.json") in line and "model.init_args.model" in line


# --------------------------------------------------------------- layout and precision
def test_moe_with_tensor_parallel_needs_sequence_parallel(capsys, tmp_path):
    moe = dict(MODEL, num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2)
    line = refused(capsys, tmp_path, write_config(tmp_path, model=moe))
    assert "invalid parallel layout" in line and "needs sequence_parallel=True" in line
    assert "trainer.strategy.init_args.sequence_parallel=False" in line
    assert "trainer.strategy.init_args.tensor_model_parallel_size=2" in line
    # and with it, the same model and layout pass every check
    validate_layout(2, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                    model=GPTConfig(**moe))


def test_moe_check_matches_mcore():
    """mcore's own MoE layer refuses the same layout in training (its message, our check)."""
    import inspect

    from megatron.core.transformer.moe.moe_layer import MoELayer

    source = inspect.getsource(MoELayer.forward)
    assert "not self.config.sequence_parallel" in source and "size() > 1" in source
    with pytest.raises(LayoutError, match="sequence_parallel"):
        validate_layout(4, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2),
                        model=tiny_config(num_moe_experts=4, moe_ffn_hidden_size=64))
    validate_layout(2, ParallelConfig(expert_model_parallel_size=2),  # TP=1: nothing to split
                    model=tiny_config(num_moe_experts=4, moe_ffn_hidden_size=64))


@pytest.mark.parametrize("precision", ["16-true", "bf16-true"])
def test_unsupported_precision(capsys, tmp_path, precision):
    line = refused(capsys, tmp_path, write_config(tmp_path), "--trainer.precision", precision)
    assert f"trainer.precision={precision}" in line and "'32-true' or 'bf16-mixed'" in line


# --------------------------------------------------------------- ckpt_path
def test_ckpt_path_missing(capsys, tmp_path):
    line = refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", str(tmp_path / "nope.ckpt"))
    assert f"ckpt_path={tmp_path / 'nope.ckpt'} does not exist" in line


def test_ckpt_path_a_file(capsys, tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04not a checkpoint")
    line = refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", str(tmp_path / "model.ckpt"))
    assert f"ckpt_path={tmp_path / 'model.ckpt'} is not a MegatronStrategy checkpoint" in line


def test_ckpt_path_a_directory_without_checkpoint(capsys, tmp_path):
    (tmp_path / "empty.ckpt").mkdir()
    (tmp_path / "empty.ckpt" / "notes.txt").write_text("mine")
    line = refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", str(tmp_path / "empty.ckpt"))
    assert "is not a MegatronStrategy checkpoint" in line and "common.pt" in line


def fake_checkpoint(directory: Path, config: GPTConfig, **extra) -> Path:
    """A checkpoint directory whose common.pt says it holds `config` (as MegatronStrategy writes)."""
    (directory / "weights").mkdir(parents=True)
    megatron = {"model_config": dataclasses.asdict(config), "parallel": {"tensor_model_parallel_size": 2},
                "dtype": "float32", **extra}
    torch.save({"global_step": 2, "megatron": megatron}, directory / "common.pt")
    return directory


def test_ckpt_path_of_another_model(capsys, tmp_path):
    other = fake_checkpoint(tmp_path / "other.ckpt", GPTConfig(**dict(MODEL, num_layers=4, hidden_size=128)))
    line = refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", str(other))
    assert f"ckpt_path {other} was saved with a different model config" in line
    assert "num_layers: checkpoint 4 vs model 2" in line and "hidden_size: checkpoint 128 vs model 64" in line


def test_ckpt_path_with_truncated_common_pt(capsys, tmp_path):
    ckpt = fake_checkpoint(tmp_path / "cut.ckpt", GPTConfig(**MODEL))
    data = (ckpt / "common.pt").read_bytes()
    (ckpt / "common.pt").write_bytes(data[: len(data) // 2])
    line = refused(capsys, tmp_path, write_config(tmp_path), "--ckpt_path", str(ckpt))
    assert f"{ckpt / 'common.pt'} cannot be read" in line and "incomplete or damaged" in line


def test_model_checkpoint_with_truncated_common_pt(capsys, tmp_path):
    ckpt = fake_checkpoint(tmp_path / "base.ckpt", GPTConfig(**MODEL))
    data = (ckpt / "common.pt").read_bytes()
    (ckpt / "common.pt").write_bytes(data[:100])
    line = refused(capsys, tmp_path, write_config(tmp_path, model=str(ckpt)))
    assert f"model.init_args.model={ckpt}" in line and f"{ckpt / 'common.pt'} cannot be read" in line


def test_fine_tuning_a_windowed_checkpoint_beyond_its_window(capsys, tmp_path):
    """A checkpoint of a Mistral (window 8) fine-tuned at seq_length 32: one that records its
    window goes on (windows are computed); one saved before they were (trained at seq_length 8,
    no window recorded) is refused: beyond 8 tokens it would attend where its HF model does not."""
    source = tmp_path / "mistral"
    transformers.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, sliding_window=8).save_pretrained(source)
    config, family = gpt_config_from_hf(source, seq_length=8)
    assert config.sliding_window == 8
    old = fake_checkpoint(tmp_path / "old.ckpt", dataclasses.replace(config, sliding_window=None),
                          hf_family=family, hf_path=str(source))
    line = refused(capsys, tmp_path, write_config(tmp_path, model=str(old), model_overrides={"seq_length": 32}))
    assert f"model.init_args.model={old} has sliding_window=None" in line
    assert "sliding_window=8" in line and str(source / "config.json") in line

    windowed = fake_checkpoint(tmp_path / "new.ckpt", config, hf_family=family, hf_path=str(source))
    with pytest.raises(AssertionError, match="Trainer.fit must not run"):  # every check passed
        main(["fit", "--config", write_config(tmp_path, model=str(windowed), model_overrides={"seq_length": 32})])


# --------------------------------------------------------------- HF weights
def test_truncated_safetensors(capsys, tmp_path, hf_llama):
    hf = copy_of(hf_llama, tmp_path / "hf")
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    line = refused(capsys, tmp_path, write_config(tmp_path, model=str(hf)))
    assert f"{hf / 'model.safetensors'} cannot be read" in line and "incomplete or damaged" in line


def test_missing_safetensors_shard(capsys, tmp_path, hf_llama):
    hf = tmp_path / "hf"
    model = transformers.LlamaForCausalLM.from_pretrained(hf_llama)
    model.save_pretrained(hf, max_shard_size="100KB")
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    line = refused(capsys, tmp_path, write_config(tmp_path, model=str(hf)))
    assert "model.safetensors.index.json names shard(s) that are not in the directory" in line
    assert shards[-1].name in line


# --------------------------------------------------------------- chat and preference data
def test_tokenizer_without_chat_template(capsys, tmp_path):
    data = json.loads(json.dumps(SFT_DATA))
    data["init_args"]["chat_template"] = None
    line = refused(capsys, tmp_path, write_config(tmp_path, data, "SFTModule"))
    assert f"tokenizer '{TOKENIZER}'" in line and "no chat template" in line
    assert "chat_template='chatml'" in line


def sft_with(tmp_path: Path, records) -> str:
    data = json.loads(json.dumps(SFT_DATA))
    data["init_args"]["paths"] = write_jsonl(tmp_path / "chat.jsonl", records)
    return write_config(tmp_path, data, "SFTModule")


def test_sft_empty_file(capsys, tmp_path):
    line = refused(capsys, tmp_path, sft_with(tmp_path, []))
    assert f"{tmp_path / 'chat.jsonl'}" in line and "holds no records" in line


def test_sft_wrong_fields(capsys, tmp_path):
    records = [{"conversation": r["messages"]} for r in sft_records()]
    line = refused(capsys, tmp_path, sft_with(tmp_path, records))
    assert f"{tmp_path / 'chat.jsonl'}" in line and "cannot tell the format" in line
    assert "'conversation'" in line and "columns=" in line


def test_sft_unknown_role(capsys, tmp_path):
    records = sft_records()
    records[3]["messages"][0]["role"] = "human"
    line = refused(capsys, tmp_path, sft_with(tmp_path, records))
    assert f"{tmp_path / 'chat.jsonl'}" in line and "sample 3, message 0: unknown role 'human'" in line
    assert "roles={'human': 'user'}" in line


def test_sft_missing_content(capsys, tmp_path):
    records = sft_records()
    del records[1]["messages"][1]["content"]
    line = refused(capsys, tmp_path, sft_with(tmp_path, records))
    assert "sample 1, message 1: field 'content' is missing" in line and "chat.jsonl" in line


def test_sft_invalid_json_line(capsys, tmp_path):
    path = tmp_path / "chat.jsonl"
    config = sft_with(tmp_path, sft_records())
    path.write_text(path.read_text() + '{"messages": [\n')
    line = refused(capsys, tmp_path, config)
    assert f"{path}' line 17 is not valid JSON" in line


def dpo_with(tmp_path: Path, records) -> str:
    data = json.loads(json.dumps(DPO_DATA))
    data["init_args"]["paths"] = write_jsonl(tmp_path / "pairs.jsonl", records)
    return write_config(tmp_path, data, "DPOModule")


def test_dpo_missing_rejected_column(capsys, tmp_path):
    records = [json.loads(line) for line in (SAMPLES / "dpo.jsonl").read_text().splitlines()]
    records = [{"prompt": r["prompt"], "chosen": r["chosen"], "bad": r["rejected"]} for r in records]
    line = refused(capsys, tmp_path, dpo_with(tmp_path, records))
    assert f"{tmp_path / 'pairs.jsonl'}" in line and "column 'rejected'" in line and "'bad'" in line


def test_dpo_empty_file(capsys, tmp_path):
    line = refused(capsys, tmp_path, dpo_with(tmp_path, []))
    assert f"{tmp_path / 'pairs.jsonl'}" in line and "holds no records" in line


# --------------------------------------------------------------- pretraining text
def test_pretrain_whitespace_only_text(capsys, tmp_path):
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    data = json.loads(json.dumps(PRETRAIN_DATA))
    data["init_args"]["paths"] = str(tmp_path / "blank.txt")
    line = refused(capsys, tmp_path, write_config(tmp_path, data))
    assert f"{tmp_path / 'blank.txt'}" in line and "holds no text" in line


def test_pretrain_jsonl_without_text_field(capsys, tmp_path):
    data = json.loads(json.dumps(PRETRAIN_DATA))
    data["init_args"]["paths"] = write_jsonl(tmp_path / "docs.jsonl", [{"body": "Some text."}])
    line = refused(capsys, tmp_path, write_config(tmp_path, data))
    assert "field 'text' not found" in line and "docs.jsonl" in line and "['body']" in line


# --------------------------------------------------------------- inputs at run time (Python API)
def test_inputs_longer_than_seq_length_are_refused_where_they_enter():
    module = PretrainModule(tiny_config(seq_length=16))
    strategy = MegatronStrategy(global_batch_size=2)
    strategy.connect(module)
    with pytest.raises(ValueError, match=r"token rows have 17 tokens, more than the model's seq_length=16"):
        module.forward_logits(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"batch rows have 32 tokens, more than the model's seq_length=16"):
        strategy.split_microbatches({"tokens": torch.zeros(2, 32, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(7\) is longer than "
                                         r"the model's seq_length=16; use at most 6 new tokens"):
        module.generate(list(range(10)), max_new_tokens=7)
    assert strategy.split_microbatches({"tokens": torch.zeros(2, 16, dtype=torch.long)})  # the limit itself


def test_seq_length_override_beyond_max_position_embeddings():
    hf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  max_position_embeddings=128).to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    assert gpt_config_from_hf(hf, seq_length=128)[0].seq_length == 128
    with pytest.raises(HFCheckpointError, match=r"max_position_embeddings=128: seq_length=129"):
        gpt_config_from_hf(hf, seq_length=129)


class LogitsAndRefusal(L.Callback):
    """Rank 0 saves the logits of the predicted batch, and forward_logits' logits of `long` or
    what it says to `too_long`."""

    def __init__(self, out: Path, long: torch.Tensor, too_long: torch.Tensor) -> None:
        self.out, self.long, self.too_long = out, long, too_long

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        long = pl_module.forward_logits(self.long)
        try:
            pl_module.forward_logits(self.too_long)
            refusal = None
        except ValueError as error:
            refusal = str(error)
        if trainer.global_rank == 0:
            torch.save({"logits": outputs, "long": long, "refusal": refusal}, self.out)


@pytest.mark.distributed
def test_sliding_window_model_takes_inputs_longer_than_the_window(tmp_path):
    """Mistral with sliding_window=8 at seq_length=32: 8 and 32 tokens (where transformers masks
    keys further than 8 back) give transformers' logits; 33 tokens, longer than the model's
    seq_length, are refused."""
    directory = tmp_path / "mistral"
    config = transformers.MistralConfig(vocab_size=200, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=256,
                                        sliding_window=8)
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(config).eval()
    hf.save_pretrained(directory)
    generator = torch.Generator().manual_seed(1)
    short = torch.randint(0, 200, (2, 8), generator=generator)
    long = torch.randint(0, 200, (1, 32), generator=generator)
    too_long = torch.randint(0, 200, (1, 33), generator=generator)
    # beyond the window transformers' own logits differ from full attention's
    unwindowed = transformers.MistralConfig(**{**config.to_dict(), "sliding_window": None})
    full = transformers.MistralForCausalLM(unwindowed)
    full.load_state_dict(hf.state_dict())
    assert (hf_logits(full.eval(), long) - hf_logits(hf, long)).abs().max() > 1e-2

    out = tmp_path / "out.pt"
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=2, start_method="fork"),
        callbacks=[LogitsAndRefusal(out, long, too_long)],
    )
    module = PretrainModule(str(directory), model_overrides={"seq_length": 32})
    trainer.predict(module, DataLoader([{"tokens": t} for t in short], batch_size=2))
    saved = torch.load(out)
    assert (saved["logits"] - hf_logits(hf, short)).abs().max().item() <= 1e-4
    assert (saved["long"] - hf_logits(hf, long)).abs().max().item() <= 1e-4
    assert saved["refusal"] and "33 tokens, more than the model's seq_length=32" in saved["refusal"]


# --------------------------------------------------------------- failures inside the workers
def launch(config: str, *args: str, start: Optional[str] = None, timeout: int = 240,
           **env: str) -> subprocess.CompletedProcess:
    """`lightning-mcore fit` as a user runs it: 2 ranks, real exit code, stdout and stderr, the
    command's process forked from this one (forked_process.py: the imports are done). `start`: how
    the ranks start. None: the CLI's default on CPU (the command's process is rank 0 and forks
    rank 1, strategy/forked_ranks.py); "popen" (rank 1 re-runs the command, the default on GPU)
    and "fork" (Lightning's: both forked from the command's process, which runs no rank), each
    with the command in a fresh interpreter."""
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env)
    argv = ["fit", "--config", config, *args]
    argv += ["--trainer.strategy.init_args.start_method", start] if start else []
    if start in ("popen", "fork"):  # popen: rank 1 re-runs the command as a fresh interpreter was
        # given it; fork: Lightning refuses to fork ranks from a process forked from one that asked
        # CUDA for its devices (this one has: conftest), a fresh interpreter has not
        return subprocess.run([sys.executable, "-m", "lightning_mcore.cli", *argv], cwd=Path(config).parent,
                              env=env, capture_output=True, text=True, timeout=timeout)
    return forked_process.run(forked_process.cli_command, [str(forked_process.CLI), *argv],
                              cwd=Path(config).parent, env=env, timeout=timeout)


def worker_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr[-3000:]
    return error_line(result.stderr)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real checkpoint of the tiny model: 2 steps, TP=2 on 2 ranks (the CLI's default on CPU:
    how the ranks start is not what the tests that read it are about)."""
    directory = tmp_path_factory.mktemp("trained")
    result = launch(write_config(directory))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (directory / "run" / "last.ckpt" / "common.pt").is_file()
    return directory / "run" / "last.ckpt"


@pytest.mark.distributed
def test_truncated_checkpoint_shard(tmp_path, trained):
    ckpt = shutil.copytree(trained, tmp_path / "cut.ckpt")
    shard = sorted((ckpt / "weights").glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    (tmp_path / "probe").mkdir()
    config = write_config(tmp_path / "probe")
    before = snapshot(tmp_path)
    line = worker_error(launch(config, "--ckpt_path", str(ckpt), "--trainer.max_steps", "3"))
    assert f"{ckpt / 'weights'} cannot be read" in line and "truncated or damaged" in line
    assert not line.startswith("error: (rank")  # rank 0 reported it
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # the checkpoint is untouched
    new = [k for k in after if k not in before and not k.startswith(("probe/cache/", "probe/logs/"))]
    assert not new, new  # no checkpoint, not even a temporary one


@pytest.mark.distributed
def test_text_shorter_than_one_sequence(tmp_path):
    (tmp_path / "short.txt").write_text("Only a few words here.\n")
    data = json.loads(json.dumps(PRETRAIN_DATA))
    data["init_args"]["paths"] = str(tmp_path / "short.txt")
    config = write_config(tmp_path, data)
    line = worker_error(launch(config))
    assert "but one sequence needs seq_length + 1 = 33" in line and str(tmp_path / "short.txt") in line
    assert not line.startswith("error: (rank")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.distributed
@pytest.mark.parametrize("start", [None, "popen", "fork"])
def test_refusal_on_one_rank_only(tmp_path, start):
    """Rank 1 refuses while rank 0 waits for it in a collective: rank 1 reports (after giving
    rank 0 the time to), rank 0's broken collective adds no traceback; under each launcher
    (under fork the command's process, which runs no rank, adds none either)."""
    (tmp_path / "blank.txt").write_text("  \n")
    data = json.loads(json.dumps(PRETRAIN_DATA))
    data["class_path"] = "rank_fault.RankOneRefuses"
    result = launch(write_config(tmp_path, data), start=start, RANK_FAULT_FILE=str(tmp_path / "blank.txt"))
    assert result.returncode == 1, result.stderr[-3000:]
    line = error_line(result.stderr)
    assert line.startswith("error: (rank 1) ") and f"{tmp_path / 'blank.txt'}' holds no text" in line


@pytest.mark.distributed
def test_export_errors_name_the_export_flags(capsys, tmp_path, trained):
    """`export` speaks of its own flags: --checkpoint (not fit's ckpt_path) and, for a peft
    export of a run without LoRA, --mode merged (the default, which works on it)."""
    for given in (tmp_path / "nope.ckpt", tmp_path):
        with pytest.raises(SystemExit) as exit_info:
            main(["export", "--checkpoint", str(given), "--output", str(tmp_path / "hf")])
        line = export_error(capsys.readouterr().err)
        assert exit_info.value.code == 2 and line.startswith(f"--checkpoint {given} "), line
        assert "ckpt_path" not in line
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--checkpoint", str(trained), "--output", str(tmp_path / "peft"), "--mode", "peft"])
    line = export_error(capsys.readouterr().err)
    assert exit_info.value.code == 2 and "export it with --mode merged" in line, line
    assert not (tmp_path / "peft").exists()
    main(["export", "--checkpoint", str(trained), "--output", str(tmp_path / "merged"), "--mode", "merged"])
    assert (tmp_path / "merged" / "model.safetensors").is_file()  # the suggestion works as said


def export_error(err: str) -> str:
    """What follows `lightning-mcore export: error: ` on stderr's one line."""
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("lightning-mcore export: error: "), err[-3000:]
    return line.removeprefix("lightning-mcore export: error: ")
