"""Every config in configs/ parses and instantiates (trainer, strategy, module with its GPTConfig,
data module) short of building the model, and its parallel layout fits the model's shape and the
world size. GPU configs run here with `--trainer.accelerator cpu` (same devices); HF model paths
point at stub directories holding the real models' config.json (no weights: a model.safetensors
without tensors) and the bundled tokenizer (with a chat template, as the real ones have); data
paths at the bundled samples. Config mistakes (unknown key, wrong type, a layout that cannot work,
a missing model directory) end with a message naming the key, exit code 2 and no traceback,
before any process starts."""

import json
import os
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import yaml
from safetensors.torch import save_file

from lightning_mcore.cli import MegatronCLI
from lightning_mcore.data.chat import CHATML

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
TOKENIZER = ROOT / "configs" / "sample_data" / "tokenizer"
SAMPLES = {  # data module class -> bundled sample for its `paths`
    "lightning_mcore.data.SFTDataModule": "configs/sample_data/sft.jsonl",
    "lightning_mcore.data.DPODataModule": "configs/sample_data/dpo.jsonl",
    "lightning_mcore.data.KTODataModule": "configs/sample_data/kto.jsonl",
    "lightning_mcore.data.RewardDataModule": "configs/sample_data/reward.jsonl",
    "lightning_mcore.data.PretrainDataModule": "configs/sample_data/sample.txt",
    "lightning_mcore.data.PromptDataModule": "configs/sample_data/prompts.jsonl",
    "lightning_mcore.data.VisionLanguageDataModule": "configs/sample_data/vlm/vlm.jsonl",
}

# The real models' config.json values (no weights are ever read at instantiation).
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128009,
)
LLAMA31_8B_INSTRUCT = dict(
    LLAMA3_8B, max_position_embeddings=131072, eos_token_id=[128001, 128008, 128009],
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
    tie_word_embeddings=False, use_sliding_window=False, router_aux_loss_coef=0.001,
    bos_token_id=151643, eos_token_id=151645,
)
QWEN2_5_VL_7B = dict(  # Qwen/Qwen2.5-VL-7B-Instruct (transformers 5 layout)
    architectures=["Qwen2_5_VLForConditionalGeneration"], image_token_id=151655,
    video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False,
    text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu",
                     rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                          mrope_section=[16, 24, 24])),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                       tokens_per_second=2),
)
# Placeholder model directories the configs may name -> (transformers config class, values).
HF_STUBS = {
    "checkpoints/Meta-Llama-3-8B-Instruct": ("LlamaConfig", LLAMA3_8B),
    "checkpoints/Qwen3-30B-A3B": ("Qwen3MoeConfig", QWEN3_30B_A3B),
    "checkpoints/Llama-3.1-8B-Instruct": ("LlamaConfig", LLAMA31_8B_INSTRUCT),
    "checkpoints/Qwen2.5-VL-7B-Instruct": ("Qwen2_5_VLConfig", QWEN2_5_VL_7B),
}


@pytest.fixture(autouse=True)
def no_leaked_seed():
    """`seed_everything:` in a config sets PL_GLOBAL_SEED / PL_SEED_WORKERS in os.environ; forked
    ranks of later tests would inherit them (and train differently). Restored after each test."""
    names = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_leaked_torch_flags():
    """`trainer.deterministic: true` turns on torch's deterministic algorithms process-wide."""
    import torch

    saved = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark = saved[1]


@pytest.fixture(autouse=True)
def no_fit(monkeypatch):
    """Nothing here may start training (a missed error would otherwise launch processes)."""
    def refuse(*args, **kwargs):
        raise AssertionError("Trainer.fit must not run in config tests")

    monkeypatch.setattr(L.Trainer, "fit", refuse)
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def hf_stubs(tmp_path_factory):
    """Placeholder path -> a directory with the real config.json and the bundled tokenizer."""
    import transformers

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for placeholder, (config_class, values) in HF_STUBS.items():
        directory = root / Path(placeholder).name
        getattr(transformers, config_class)(**values).save_pretrained(directory)
        for file in TOKENIZER.iterdir():
            shutil.copy(file, directory / file.name)
        save_file({}, directory / "model.safetensors")  # a complete header, no tensors
        if "vision_config" in values:  # a vision-language model also has its image processor
            shutil.copy(ROOT / "configs/sample_data/tiny-qwen2_5-vl/preprocessor_config.json", directory)
        # The real instruct models' tokenizers carry a chat template (the configs rely on it).
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = CHATML
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        dirs[placeholder] = str(directory)
    return dirs


@pytest.fixture(scope="module")
def indexed_prefix(tmp_path_factory):
    """A tiny mcore indexed dataset of the bundled sample text."""
    from lightning_mcore.data.preprocess import main as preprocess

    out = tmp_path_factory.mktemp("indexed")
    preprocess(["--input", str(ROOT / "configs" / "sample_data" / "sample.txt"),
                "--tokenizer", str(TOKENIZER), "--output-prefix", str(out / "sample"),
                "--append-eos", "--cache-dir", str(out / "cache")])
    return str(out / "sample")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def runnable_args(name: str, tmp_path, hf_stubs, indexed_prefix) -> list:
    """`--config configs/NAME` plus what makes it instantiate here: CPU instead of GPU (devices
    kept), stub HF directories, bundled data, outputs and caches under tmp_path."""
    cfg = load(name)
    trainer, model, data = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    args = ["--config", f"configs/{name}", "--data.init_args.cache_dir", str(tmp_path / "cache")]
    if trainer.get("accelerator") == "gpu":
        args += ["--trainer.accelerator", "cpu"]
    if trainer.get("logger"):
        args += ["--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]
    if isinstance(model["model"], str) and not (ROOT / model["model"]).is_dir():  # not bundled
        assert model["model"] in hf_stubs, f"{name}: unknown placeholder model {model['model']}"
        args += ["--model.init_args.model", hf_stubs[model["model"]]]
    overrides = model.get("model_overrides") or {}
    if model.get("lora") and overrides.get("moe_grouped_gemm"):
        # On CPU mcore builds its legacy GroupedMLP, which takes no expert adapters (refused before
        # launch): check the plan with SequentialMLP experts, whose adapters TE's grouped ones share.
        args += ["--model.init_args.model_overrides", json.dumps({**overrides, "moe_grouped_gemm": False})]
    tokenizer = data["tokenizer"]
    if tokenizer in hf_stubs:
        args += ["--data.init_args.tokenizer", hf_stubs[tokenizer]]
    elif not (ROOT / tokenizer).is_dir():
        args += ["--data.init_args.tokenizer", str(TOKENIZER)]
    if data.get("paths") is not None and not (ROOT / data["paths"]).exists():
        args += ["--data.init_args.paths", SAMPLES[cfg["data"]["class_path"]]]
    if data.get("indexed_prefixes") is not None:
        args += ["--data.init_args.indexed_prefixes", f'["{indexed_prefix}"]']
    return args


def callback(cli, cls_name: str):
    found = [c for c in cli.trainer.callbacks if type(c).__name__ == cls_name]
    assert len(found) == 1, [type(c).__name__ for c in cli.trainer.callbacks]
    return found[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_instantiates(name, tmp_path, hf_stubs, indexed_prefix):
    from lightning_mcore import MegatronModule, MegatronStrategy

    cfg = load(name)
    header = (ROOT / "configs" / name).read_text().split("\n")[0]
    assert header.startswith("# ") and f"--config configs/{name}" in (ROOT / "configs" / name).read_text()
    cli = MegatronCLI(args=runnable_args(name, tmp_path, hf_stubs, indexed_prefix), run=False)
    strategy, module = cli.trainer.strategy, cli.model

    assert isinstance(module, MegatronModule) and module.chunks is None
    assert isinstance(strategy, MegatronStrategy)
    assert cli.datamodule is not None
    # The layout fits the world size of the config (devices kept) and the model's shape.
    devices = cfg["trainer"]["devices"] * cfg["trainer"].get("num_nodes", 1)
    assert strategy.num_nodes * strategy.num_processes == devices
    strategy.validate(module.model_config)
    # mcore accepts the resulting TransformerConfig (CPU flavour: local spec, no fusions).
    tf = strategy.transformer_config(module.model_config)
    assert tf.num_layers == module.model_config.num_layers
    assert tf.tensor_model_parallel_size == strategy.parallel.tensor_model_parallel_size
    assert cli.datamodule.hparams.seq_length <= module.model_config.seq_length

    if cfg["trainer"].get("accelerator") == "gpu":  # what every GPU config carries
        assert str(cli.trainer.precision) == "bf16-mixed"
        if not hasattr(module, "make_rollout"):  # GRPO logs its own rollout tokens/s and times
            callback(cli, "MegatronThroughput")
        callback(cli, "ModelCheckpoint")
        assert type(cli.trainer.logger).__name__ in ("CSVLogger", "TensorBoardLogger")
    else:  # a CPU config: last.ckpt where its header's export command reads it
        checkpoint = callback(cli, "ModelCheckpoint")
        where = f"runs/{Path(name).stem}/checkpoints"
        assert checkpoint.save_last and Path(checkpoint.dirpath) == (ROOT / where)
        mode = " --mode peft" if module.lora is not None else ""
        assert re.search(rf"lightning-mcore export --checkpoint {where}/last.ckpt --output \S+{mode}\n",
                         (ROOT / "configs" / name).read_text())


def hf_cli(name, tmp_path, hf_stubs, indexed_prefix, *extra):
    return MegatronCLI(args=runnable_args(name, tmp_path, hf_stubs, indexed_prefix) + list(extra),
                       run=False)


def test_llama3_8b_sft_lora(tmp_path, hf_stubs):
    cli = hf_cli("llama3_8b_sft_lora.yaml", tmp_path, hf_stubs, None)
    mc, p = cli.model.model_config, cli.trainer.strategy.parallel
    assert (mc.num_layers, mc.hidden_size, mc.ffn_hidden_size) == (32, 4096, 14336)
    assert (mc.num_attention_heads, mc.num_query_groups, mc.vocab_size) == (32, 8, 128256)
    assert mc.seq_length == 4096 and mc.rotary_base == 500000 and cli.model.hf_family == "llama"
    assert (p.tensor_model_parallel_size, p.sequence_parallel, cli.trainer.num_devices) == (2, True, 2)
    lora = cli.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (16, 32, "all-linear")
    assert callback(cli, "HFExport").mode == "peft"
    dm = cli.datamodule
    assert type(dm).__name__ == "SFTDataModule" and dm.hparams.chat_template is None
    assert dm.hparams.tokenizer == cli.model.hf_path and dm.hparams.seq_length == 4096


def test_llama3_8b_sft(tmp_path, hf_stubs):
    cli = hf_cli("llama3_8b_sft.yaml", tmp_path, hf_stubs, None)
    mc, s = cli.model.model_config, cli.trainer.strategy
    p = s.parallel
    assert (mc.num_layers, mc.num_query_groups) == (32, 8) and cli.model.lora is None
    assert mc.recompute_granularity in ("full", "selective")
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (2, 2)
    assert s.num_processes in (4, 8) and s.data_parallel_size == s.num_processes // 4
    assert p.use_distributed_optimizer and p.overlap_grad_reduce
    assert s.transformer_config(mc).recompute_granularity == mc.recompute_granularity
    assert callback(cli, "HFExport").mode == "full"


def test_qwen3_30b_a3b_sft(tmp_path, hf_stubs):
    cli = hf_cli("qwen3_30b_a3b_sft.yaml", tmp_path, hf_stubs, None)
    mc, s = cli.model.model_config, cli.trainer.strategy
    p = s.parallel
    assert (mc.num_layers, mc.num_query_groups, mc.num_moe_experts, mc.moe_router_topk) == (48, 4, 128, 8)
    assert mc.moe_ffn_hidden_size == 768 and mc.qk_layernorm and cli.model.hf_family == "qwen3_moe"
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (2, 2)
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size) == (4, 1)
    assert p.sequence_parallel and p.use_distributed_optimizer and s.num_processes == 8
    assert mc.moe_grouped_gemm and mc.moe_token_dispatcher_type == "alltoall"
    assert mc.recompute_granularity in ("full", "selective")
    tf = s.transformer_config(mc)
    # grouped GEMM on torch's kernel ('auto'): mcore builds its SequentialMLP parameters, we compute
    assert mc.torch_experts and not tf.moe_grouped_gemm and tf.moe_token_dispatcher_type == "alltoall"
    assert (tf.expert_model_parallel_size, tf.expert_tensor_parallel_size) == (4, 1)
    assert tf.num_moe_experts == 128 and tf.moe_aux_loss_coeff > 0


def test_qwen3_30b_a3b_sft_lora(tmp_path, hf_stubs):
    from lightning_mcore.lora.config import adapts_experts

    cli = hf_cli("qwen3_30b_a3b_sft_lora.yaml", tmp_path, hf_stubs, None)
    mc, s, lora = cli.model.model_config, cli.trainer.strategy, cli.model.lora
    p = s.parallel
    assert (mc.num_layers, mc.num_moe_experts, mc.moe_router_topk, mc.moe_ffn_hidden_size) == (48, 128, 8, 768)
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 32, "all-linear") and adapts_experts(lora, mc)
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size, s.num_processes) == (2, 1, 2)
    assert load("qwen3_30b_a3b_sft_lora.yaml")["model"]["init_args"]["model_overrides"]["moe_grouped_gemm"]
    assert mc.moe_token_dispatcher_type == "alltoall"  # grouped GEMM: off on CPU (runnable_args)
    assert mc.recompute_granularity == "full" and cli.datamodule.hparams.packing
    assert callback(cli, "HFExport").mode == "peft"


def test_llama3_8b_dpo_lora(tmp_path, hf_stubs):
    cli = hf_cli("llama3_8b_dpo_lora.yaml", tmp_path, hf_stubs, None)
    from lightning_mcore import DPOModule
    from lightning_mcore.data import DPODataModule

    assert isinstance(cli.model, DPOModule) and isinstance(cli.datamodule, DPODataModule)
    assert (cli.model.model_config.num_layers, cli.model.model_config.num_query_groups) == (32, 8)
    assert cli.model.lora.rank == 16 and cli.model.beta == pytest.approx(0.1)
    assert cli.trainer.strategy.parallel.tensor_model_parallel_size == 2
    assert cli.datamodule.hparams.tokenizer == cli.model.hf_path


def test_grpo_8b_lora(tmp_path, hf_stubs):
    cli = hf_cli("grpo_8b_lora.yaml", tmp_path, hf_stubs, None)
    from lightning_mcore import GRPOModule
    from lightning_mcore.data import PromptDataModule
    from lightning_mcore.rewards import boxed_answer

    module, strategy = cli.model, cli.trainer.strategy
    assert isinstance(module, GRPOModule) and isinstance(cli.datamodule, PromptDataModule)
    mc = module.model_config
    assert (mc.num_layers, mc.hidden_size, mc.num_query_groups) == (32, 4096, 8)
    assert (mc.rope_scaling["rope_type"], mc.rope_scaling["factor"]) == ("llama3", 8.0)  # config.json's
    assert module.lora.rank == 16 and module.reward_funcs == [boxed_answer]
    assert (module.num_generations, module.max_completion_length) == (8, 1024)
    assert cli.datamodule.max_prompt_length + module.max_completion_length <= mc.seq_length
    assert strategy.parallel.tensor_model_parallel_size == 2 and strategy.num_processes == 2
    assert strategy.batch.global_batch_size % module.num_generations == 0
    # trainer.deterministic reaches the strategy and mcore's config, and the environment is set
    assert strategy.deterministic and strategy.transformer_config(mc).deterministic_mode
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0" and os.environ["NCCL_ALGO"] == "Ring"
    assert cli.datamodule.hparams.tokenizer == module.hf_path


def test_kto(tmp_path, hf_stubs):
    cli = hf_cli("kto.yaml", tmp_path, hf_stubs, None)
    from lightning_mcore import KTOModule
    from lightning_mcore.data import KTODataModule

    assert isinstance(cli.model, KTOModule) and isinstance(cli.datamodule, KTODataModule)
    assert cli.model.lora.rank == 8 and cli.model.beta == pytest.approx(0.1)
    assert (cli.model.desirable_weight, cli.model.undesirable_weight) == (1.0, 1.0)
    assert cli.datamodule.hparams.seq_length <= cli.model.model_config.seq_length


def test_reward(tmp_path, hf_stubs):
    from lightning_mcore.data.reward import RewardDataModule
    from lightning_mcore.objectives.reward import RewardModule

    cli = hf_cli("reward.yaml", tmp_path, hf_stubs, None)
    assert isinstance(cli.model, RewardModule) and isinstance(cli.datamodule, RewardDataModule)
    assert cli.model.hf_family == "llama" and cli.model.seq_cls_class == "LlamaForSequenceClassification"
    assert not cli.model.hf_scores  # a causal LM: the score head starts at zero


def test_pretrain_indexed(tmp_path, hf_stubs, indexed_prefix):
    # The sample text has ~20k tokens: too few documents for a validation split of 4097-token rows.
    cli = hf_cli("pretrain_indexed.yaml", tmp_path, hf_stubs, indexed_prefix, "--data.init_args.val_split", "0")
    mc, s = cli.model.model_config, cli.trainer.strategy
    assert (mc.num_layers, mc.hidden_size, mc.ffn_hidden_size) == (16, 2048, 8192)
    assert (mc.num_attention_heads, mc.num_query_groups, mc.vocab_size, mc.seq_length) == (32, 8, 128256, 4096)
    # ~1B parameters: embeddings (tied) + per layer attention (GQA) and SwiGLU.
    h, kv = mc.hidden_size, mc.num_query_groups * mc.head_dim
    params = mc.vocab_size * h + mc.num_layers * (2 * h * h + 2 * h * kv + 3 * h * mc.ffn_hidden_size)
    assert 1.0e9 < params < 1.5e9, params
    assert s.parallel.use_distributed_optimizer and s.num_processes == 8
    dm = cli.datamodule
    assert dm.hparams.paths is None and dm.indexed_prefixes == [indexed_prefix]
    dm.setup("fit")  # mcore's GPTDataset opens the .bin/.idx: 4097-token samples of the sample text
    sample = dm.train_dataset[0]
    assert sample["tokens"].shape == (4096,) and len(dm.train_dataset) >= 1


# ---------------------------------------------------------------------- config mistakes
def fails(capsys, *args) -> str:
    """Run `lightning-mcore fit ...`; it must exit with code 2 and no traceback. Returns stderr."""
    with pytest.raises(SystemExit) as exit_info:
        MegatronCLI(args=["fit", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_wrong_key_is_named(capsys):
    err = fails(capsys, "--config", "configs/sft.yaml", "--model.init_args.optim.learning_rate", "1")
    assert "learning_rate" in err


def test_wrong_type_is_named(capsys):
    err = fails(capsys, "--config", "configs/sft.yaml", "--trainer.max_steps", "abc")
    assert "trainer.max_steps" in err and "abc" in err


def test_layout_world_size_mistake_is_named(capsys):
    err = fails(capsys, "--config", "configs/sft.yaml",
                "--trainer.strategy.init_args.tensor_model_parallel_size", "3")
    assert "error: invalid parallel layout" in err
    assert "trainer.strategy.init_args.tensor_model_parallel_size=3" in err
    assert "trainer.devices=2" in err and "world size 2 is not divisible" in err


def test_layout_model_shape_mistake_is_named(capsys):
    # 4 ranks hold TP=4 fine, but the model has 2 query groups: refused before fit starts.
    err = fails(capsys, "--config", "configs/quickstart.yaml", "--trainer.devices", "4",
                "--trainer.strategy.init_args.tensor_model_parallel_size", "4")
    assert "error: invalid parallel layout" in err
    assert "trainer.strategy.init_args.tensor_model_parallel_size=4" in err
    assert "model.init_args.model.num_query_groups=2" in err


def test_layout_mistake_names_hf_model(capsys, tmp_path, hf_stubs):
    # Llama-3-8B has 8 key/value heads: TP=16 cannot split them.
    args = runnable_args("llama3_8b_sft_lora.yaml", tmp_path, hf_stubs, None)
    err = fails(capsys, *args, "--trainer.devices", "16",
                "--trainer.strategy.init_args.tensor_model_parallel_size", "16")
    assert "trainer.strategy.init_args.tensor_model_parallel_size=16" in err
    assert f"model.init_args.model={hf_stubs['checkpoints/Meta-Llama-3-8B-Instruct']}" in err
    assert "num_query_groups (8" in err


def test_sgd_with_distributed_optimizer_is_named(capsys):
    err = fails(capsys, "--config", "configs/sft.yaml", "--model.init_args.optim.optimizer", "sgd",
                "--trainer.strategy.init_args.use_distributed_optimizer", "true")
    assert "error: invalid parallel layout" in err
    assert "trainer.strategy.init_args.use_distributed_optimizer=True" in err
    assert "model.init_args.optim.optimizer=sgd" in err and "shards Adam's state only" in err


def test_layout_batch_mistake_is_named(capsys):
    err = fails(capsys, "--config", "configs/sft.yaml", "--trainer.strategy.init_args.global_batch_size", "3")
    assert "trainer.strategy.init_args.global_batch_size=3" in err
    assert "trainer.strategy.init_args.micro_batch_size=2" in err


def test_missing_model_directory_is_named(capsys):
    # A shipped 8B config run before its placeholder directory was filled in.
    err = fails(capsys, "--config", "configs/llama3_8b_sft_lora.yaml",
                "--model.init_args.model", "checkpoints/does-not-exist")
    assert "error: model.init_args.model (SFTModule): checkpoints/does-not-exist is not a directory" in err


def test_missing_data_file_is_named(capsys):
    err = fails(capsys, "--config", "configs/sft.yaml", "--data.init_args.paths", "data/missing.jsonl")
    assert "error: data (SFTDataModule): no file matches 'data/missing.jsonl'" in err
    assert f"(relative to the working directory {os.getcwd()})" in err  # where it was looked for
    absolute = ROOT / "data" / "missing.jsonl"
    err = fails(capsys, "--config", "configs/sft.yaml", "--data.init_args.paths", str(absolute))
    assert f"no file matches '{absolute}'" in err and "working directory" not in err


def test_invalid_value_is_named(capsys):
    err = fails(capsys, "--config", "configs/sft_lora.yaml", "--model.init_args.lora.rank", "0")
    assert "model.init_args.lora" in err and "rank" in err


def test_print_config(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        MegatronCLI(args=["fit", "--config", "configs/quickstart.yaml", "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_mcore.MegatronStrategy"
    assert strategy["init_args"]["tensor_model_parallel_size"] == 2
    assert "pipeline_model_parallel_size" in strategy["init_args"]  # defaults are shown too
    model = printed["model"]["init_args"]["model"]
    assert model["num_layers"] == 2 and model["num_query_groups"] == 2 and "rotary_base" in model
    assert printed["data"]["init_args"]["seq_length"] == 128
    # The printed config is itself a complete config: `fit --config printed.yaml` gets to fit.
    (tmp_path / "printed.yaml").write_text(out)
    calls = []
    monkeypatch.setattr(L.Trainer, "fit", lambda self, *a, **kw: calls.append((self, kw)))
    cli = MegatronCLI(args=["fit", "--config", str(tmp_path / "printed.yaml"),
                            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    assert len(calls) == 1 and calls[0][0] is cli.trainer and calls[0][1]["model"] is cli.model
    assert cli.trainer.strategy.parallel.tensor_model_parallel_size == 2


def test_console_defaults_give_way_to_the_config():
    """Our progress bar and summary replace Lightning's defaults, unless the config turns the bar
    or the summary off, or brings its own."""
    def names(*extra):
        cli = MegatronCLI(args=["--config", "configs/quickstart.yaml", *extra], run=False)
        return [type(c).__name__ for c in cli.trainer.callbacks]

    default = names()
    assert "MegatronProgressBar" in default and "MegatronModelSummary" in default
    assert "ModelSummary" not in default and "RichModelSummary" not in default
    quiet = names("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false")
    assert not {"MegatronProgressBar", "MegatronModelSummary", "ModelSummary", "RichModelSummary"} & set(quiet)
    own = names("--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar",
                "--trainer.callbacks+=lightning.pytorch.callbacks.ModelSummary")
    assert "RichProgressBar" in own and "ModelSummary" in own
    assert "MegatronProgressBar" not in own and "MegatronModelSummary" not in own


def test_distill(tmp_path, hf_stubs):
    from lightning_mcore.objectives.distill import DistillModule

    cli = hf_cli("distill.yaml", tmp_path, hf_stubs, None)
    module = cli.model
    assert isinstance(module, DistillModule) and module.distill.divergence == "forward_kl"
    teacher, student = module.teacher.model_config, module.model_config
    assert (teacher.num_layers, student.num_layers) == (2, 1) and teacher.vocab_size == student.vocab_size == 512
    assert module.teacher.hf_path == "configs/sample_data/tiny-llama" and teacher.seq_length == student.seq_length


def test_readme_config_table_lists_every_config():
    """The table of configs (docs/configs.md) names each file of configs/ once (a user picks from it)."""
    from readme import section

    table = [line for line in section("Configs", "configs.md").splitlines()
             if line.startswith("| `") and ".yaml`" in line]
    named = [name for line in table for name in re.findall(r"`([\w.]+\.yaml)`", line.split(" | ")[0])]
    assert sorted(named) == CONFIGS, sorted(set(CONFIGS) ^ set(named))
