"""Clear errors for HF checkpoints we cannot load: each names the file or field at fault.

Errors raised while loading weights happen inside the (fork-launched) rank; they reach the
parent as torch.multiprocessing's ProcessRaisedException carrying the child's traceback. A
1-rank process group is not created in the pytest process itself: gloo's threads would outlive
it and crash the ranks later tests fork.
"""

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors import safe_open
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader

from hf_models import make_hf_model
from lightning_mcore import MegatronStrategy, PretrainModule
from lightning_mcore.hf.checkpoint import CheckpointError, SafetensorsReader, weight_map
from lightning_mcore.hf.config import HFCheckpointError, HFCheckpointNotFoundError
from lightning_mcore.strategy.parallel import LayoutError, ParallelConfig, validate_layout

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Qwen3MoeForCausalLM")


def edit_config(directory: Path, **changes) -> None:
    file = directory / "config.json"
    config = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    file.write_text(json.dumps(config))


def checkpoint_keys(directory: Path) -> set:
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def predict_error(directory: Path) -> str:
    """Load `directory` in one fork-launched rank (Trainer.predict); the rank's error line."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=1, start_method="fork"),
    )
    module = PretrainModule(str(directory))  # the config itself is fine: no error here
    with pytest.raises(ProcessRaisedException) as info:
        trainer.predict(module, DataLoader([{"tokens": torch.arange(4)}], batch_size=1))
    lines = [line for line in str(info.value).splitlines() if line.strip()]
    return lines[-1]


# ---------------------------------------------------------------- config.json
def test_unsupported_architecture_names_it_the_file_and_the_supported_ones(tmp_path):
    make_hf_model("llama", tmp_path)
    edit_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFCheckpointError) as info:
        PretrainModule(str(tmp_path))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message and str(tmp_path / "config.json") in message
    for name in SUPPORTED:
        assert name in message


def test_directory_without_config_json_names_it(tmp_path):
    make_hf_model("llama", tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(HFCheckpointNotFoundError) as info:
        PretrainModule(str(tmp_path))
    assert "config.json" in str(info.value) and str(tmp_path) in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_path_that_is_not_a_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(HFCheckpointNotFoundError, match=re.escape(str(missing))):
        PretrainModule(str(missing))


# ---------------------------------------------------------------- safetensors files
def test_shard_named_in_the_index_but_missing_is_named(tmp_path):
    model = make_hf_model("llama", tmp_path / "single")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 2 and sorted(p.name for p in sharded.glob("*.safetensors")) == shards
    assert set(weight_map(sharded)) == checkpoint_keys(tmp_path / "single")  # complete: fine
    with SafetensorsReader(sharded) as reader:
        for name, tensor in model.state_dict().items():
            if name in index:
                assert torch.equal(reader.get(name), tensor), name

    gone = index["model.layers.1.mlp.down_proj.weight"]
    (sharded / gone).unlink()
    for read in (weight_map, SafetensorsReader):
        with pytest.raises(CheckpointError) as info:
            read(sharded)
        message = str(info.value)
        assert gone in message and "model.safetensors.index.json" in message
        assert not any(s in message for s in shards if s != gone)  # only the missing one


def test_directory_without_safetensors_is_named(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        weight_map(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "model.safetensors" in message and "model.safetensors.index.json" in message


def test_tensor_not_in_the_checkpoint_is_named(tmp_path):
    make_hf_model("llama", tmp_path)
    with SafetensorsReader(tmp_path) as reader, pytest.raises(CheckpointError) as info:
        reader.shape("model.layers.4.input_layernorm.weight")  # the model has layers 0-3
    assert "model.layers.4.input_layernorm.weight" in str(info.value)
    assert str(tmp_path) in str(info.value)


# ---------------------------------------------------------------- checkpoint vs config
@pytest.mark.distributed
def test_tensor_shape_not_matching_the_config_names_tensor_file_and_config(tmp_path):
    model = make_hf_model("llama", tmp_path / "single")
    directory = tmp_path / "sharded"  # several files, so the message must name the right one
    model.save_pretrained(directory, max_shard_size="20KB")
    edit_config(directory, intermediate_size=80)  # the tensors have 96 rows / columns

    message = predict_error(directory)
    assert message.startswith("lightning_mcore.hf.checkpoint.CheckpointError: "), message
    found = re.search(r"(model\.layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight) in (\S+) has shape "
                      r"\[(\d+), (\d+)\], but config\.json implies \[(\d+), (\d+)\]", message)
    assert found, message
    tensor, file = found.group(1), found.group(2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert file == index[tensor]
    got, want = found.groups()[2:4], found.groups()[4:6]
    assert "96" in got and "80" in want and "64" in got and "64" in want
    assert "intermediate_size" in message  # the config field to look at


@pytest.mark.distributed
@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])  # transformers 5 / 4 spelling
def test_dtype_not_matching_the_config_names_tensor_file_and_dtype(field, tmp_path):
    make_hf_model("llama", tmp_path)  # float32 tensors
    edit_config(tmp_path, dtype=None, torch_dtype=None)
    edit_config(tmp_path, **{field: "bfloat16"})

    message = predict_error(tmp_path)
    found = re.search(r"CheckpointError: (\S+) in (\S+) is F32, but config\.json says dtype BF16", message)
    assert found, message
    assert found.group(1) in checkpoint_keys(tmp_path) and found.group(2) == "model.safetensors"


# ---------------------------------------------------------------- checkpoint vs layout
def test_key_value_heads_not_divisible_by_tensor_parallel_size(tmp_path):
    make_hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4
    module = PretrainModule(str(tmp_path))
    validate_layout(2, ParallelConfig(tensor_model_parallel_size=2), None, module.model_config)
    with pytest.raises(LayoutError) as info:
        validate_layout(4, ParallelConfig(tensor_model_parallel_size=4), None, module.model_config)
    message = str(info.value)
    assert "num_query_groups (2" in message and "key/value heads" in message
    assert "tensor_model_parallel_size (4)" in message


@pytest.mark.distributed
def test_checkpoint_tensor_the_model_has_no_place_for_is_refused(tmp_path):
    """An o_proj bias in a Llama checkpoint whose config says nothing of it: transformers would
    drop it with a warning; we refuse, naming it, instead of computing another model."""
    from safetensors.torch import load_file, save_file

    make_hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    line = predict_error(tmp_path)
    assert "1 tensor(s) have no place" in line and "model.layers.1.self_attn.o_proj.bias" in line, line
