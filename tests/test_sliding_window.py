"""Acceptance (sliding windows): windowed layers attend to the last W keys as transformers'
do (q - W < k <= q), at inputs 4x the window: logits equal transformers' at TP=1, TP=2+SP and
PP=2 (Mistral, Qwen3-MoE: every layer windowed; Qwen2: full and windowed layers mixed);
config.json is read (and written) as transformers reads it; a packed SFT batch equals the same
samples one per row. The local spec (SDPAttention) is what runs on CPU; TE's windowed attention
on GPU reads the same mcore window_size.
"""

import dataclasses

import lightning as L
import pytest
import torch
import transformers as tf
from megatron.core.transformer.utils import is_layer_window_attention
from torch.utils.data import DataLoader
from transformers.masking_utils import sliding_window_causal_mask_function

from hf_models import hf_logits, make_hf_model
from lightning_mcore import (
    BatchConfig,
    LayoutError,
    MegatronStrategy,
    OptimizerSettings,
    ParallelConfig,
    PretrainModule,
)
from lightning_mcore.data.packing import build_row, pack
from lightning_mcore.model.config import to_transformer_config
from lightning_mcore.models import gpt_config_from_hf, hf_config_dict_from_gpt
from lightning_mcore.objectives.sft import SFTModule
from lightning_mcore.sequence.packing import block_causal_mask, causal_mask
from lightning_mcore.strategy.parallel import validate_layout
from test_sft_packing import LENGTHS, SEQ, samples
from toy import assemble, fit, tiny_config

WINDOW, TOKENS = 8, 32  # inputs 4x the window


def test_masks_follow_transformers_rule():
    """causal_mask / block_causal_mask against transformers' own sliding-window mask function."""
    rule = sliding_window_causal_mask_function(WINDOW)
    positions = torch.arange(TOKENS)
    expected = rule(torch.tensor(0), torch.tensor(0), positions[:, None], positions[None, :])
    assert expected.shape == (TOKENS, TOKENS) and expected.sum() < TOKENS * (TOKENS + 1) // 2
    assert torch.equal(causal_mask(TOKENS, TOKENS, WINDOW), expected)
    assert not torch.equal(causal_mask(TOKENS, TOKENS), expected)  # the window removes keys
    # the last 5 queries of 32 positions (keys before them exist)
    assert torch.equal(causal_mask(5, TOKENS, WINDOW), expected[-5:])
    # packed: each sequence windowed on its own, nothing across sequences
    lengths = [12, 3, 17]
    cu = torch.tensor([0, 12, 15, 32], dtype=torch.int32)
    blocks = torch.block_diag(*(causal_mask(n, n, WINDOW).int() for n in lengths)).bool()
    assert torch.equal(block_causal_mask(cu, WINDOW), blocks)
    causal_blocks = torch.block_diag(*(causal_mask(n, n).int() for n in lengths)).bool()
    assert torch.equal(block_causal_mask(cu), causal_blocks)


def test_mcore_window_settings():
    """What TE's attention on GPU reads: window_size=(W-1, 0), whose rule (keys q - left <= k
    <= q + right, TE's docs) is transformers'; windowed layers by global layer number; nothing
    when no input can be longer than the window."""
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    cfg = tiny_config(seq_length=TOKENS, sliding_window=WINDOW, layer_types=types)
    tf = to_transformer_config(cfg, ParallelConfig(), torch.float32, on_cpu=True, use_te=False)
    left, right = tf.window_size
    q, k = torch.arange(TOKENS)[:, None], torch.arange(TOKENS)[None, :]
    assert torch.equal((k >= q - left) & (k <= q + right), causal_mask(TOKENS, TOKENS, WINDOW))
    assert [is_layer_window_attention(tf.window_size, tf.window_attn_skip_freq, n)
            for n in range(1, 5)] == [False, True, True, False]
    short = to_transformer_config(dataclasses.replace(cfg, seq_length=WINDOW), ParallelConfig(),
                                  torch.float32, on_cpu=True, use_te=False)
    assert short.window_size is None


def test_context_parallel_with_a_window_is_refused():
    """TE's ring attention (cp_comm_type p2p) asserts on windows inside every rank."""
    cp = ParallelConfig(context_parallel_size=2)
    with pytest.raises(LayoutError, match="context_parallel_size=2 with sliding-window") as info:
        validate_layout(2, cp, BatchConfig(8, 1), tiny_config(sliding_window=WINDOW), "gpu", True)
    assert info.value.options == ("context_parallel_size",)
    # a window no shorter than seq_length changes nothing: no window reaches TE
    covered = tiny_config(seq_length=WINDOW, sliding_window=WINDOW)
    validate_layout(2, cp, BatchConfig(8, 1), covered, "gpu", True)


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
CONFIGS = {  # config.json variants: (transformers config class, architecture, fields)
    "mistral": (tf.MistralConfig, "MistralForCausalLM", dict(sliding_window=8)),
    "mistral_none": (tf.MistralConfig, "MistralForCausalLM", dict(sliding_window=None)),
    # a Qwen2.5 config.json: a window that transformers drops without use_sliding_window
    "qwen2_off": (tf.Qwen2Config, "Qwen2ForCausalLM", dict(
        use_sliding_window=False, sliding_window=8, max_window_layers=1)),
    "qwen2_from_max_window_layers": (tf.Qwen2Config, "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen2_layer_types": (tf.Qwen2Config, "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    "qwen3": (tf.Qwen3Config, "Qwen3ForCausalLM", dict(
        head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=3)),
    "qwen3_moe": (tf.Qwen3MoeConfig, "Qwen3MoeForCausalLM", dict(
        head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=3, **QWEN_MOE)),
    "qwen3_moe_off": (tf.Qwen3MoeConfig, "Qwen3MoeForCausalLM", dict(
        head_dim=16, use_sliding_window=False, sliding_window=8, **QWEN_MOE)),
}


def transformers_windows(config) -> list:
    """Each layer's window as transformers' model applies it: by layer_types where the model
    has them (Qwen2, Qwen3), else config.sliding_window on every layer (Mistral, Qwen3-MoE)."""
    if getattr(config, "layer_types", None) is not None and not isinstance(config, tf.Qwen3MoeConfig):
        return [config.sliding_window if t == "sliding_attention" else None for t in config.layer_types]
    return [config.sliding_window] * config.num_hidden_layers


def our_windows(cfg) -> list:
    return [cfg.sliding_window if cfg.is_window_layer(i) else None for i in range(cfg.num_layers)]


@pytest.mark.parametrize("name", CONFIGS)
def test_windows_read_from_config_json_as_transformers_does(name):
    cls, arch, fields = CONFIGS[name]
    config = cls(**TINY, **fields, architectures=[arch])
    cfg, family = gpt_config_from_hf(config.to_dict(), seq_length=TOKENS)
    assert our_windows(cfg) == transformers_windows(config)
    # and what an export writes reads back to the same windows, in transformers too
    written = hf_config_dict_from_gpt(cfg, family)
    assert our_windows(gpt_config_from_hf(written, seq_length=TOKENS)[0]) == our_windows(cfg)
    assert transformers_windows(cls(**written)) == our_windows(cfg)


def test_window_layer_types_of_another_length_are_refused():
    config = tf.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8,
                            architectures=["Qwen2ForCausalLM"]).to_dict()
    config["layer_types"] = ["sliding_attention"] * 3
    with pytest.raises(ValueError, match="layer_types=.*3 entries for num_hidden_layers=4"):
        gpt_config_from_hf(config)


class SaveLogits(L.Callback):
    def __init__(self, out) -> None:
        self.out = out

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == 0:
            torch.save(outputs, self.out)


LAYOUTS = {
    "tp1": (1, {}),
    "tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
}
CASES = [("mistral_window", "tp1"), ("mistral_window", "tp2sp"), ("qwen2_window", "tp2sp"),
         ("qwen2_window", "pp2"), ("qwen3_moe_window", "tp1"), ("mixtral_window", "tp2sp")]


@pytest.mark.distributed
@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_logits_match_transformers_beyond_the_window(family, layout, tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model(family, source)
    assert hf.config.sliding_window == WINDOW
    if family == "qwen2_window":  # full layers first, then windowed ones (across the PP=2 stages)
        assert hf.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    tokens = torch.randint(0, hf.config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, tokens)
    # the window matters: the same weights attending to every earlier key give other logits
    full = type(hf)(type(hf.config)(**{**hf.config.to_dict(), "sliding_window": None,
                                       "use_sliding_window": False, "layer_types": None}))
    full.load_state_dict(hf.state_dict())
    assert (hf_logits(full.eval(), tokens) - expected).abs().max() > 1e-2

    devices, parallel = LAYOUTS[layout]
    out = tmp_path / "logits.pt"
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=2, start_method="fork", **parallel),
        callbacks=[SaveLogits(out)],
    )
    trainer.predict(PretrainModule(str(source)), DataLoader([{"tokens": t} for t in tokens], batch_size=2))
    logits = torch.load(out)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4


# ------------------------------------------------------------------ packed SFT
UNWINDOWED = dict(init_method_std=0.2)  # weights large enough that attention is not uniform
WINDOWED = dict(UNWINDOWED, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)


def run(tmp_path, name, rows, module_cls, window: dict, devices=1, **parallel):
    optim = OptimizerSettings(lr=1.0, optimizer="sgd", clip_grad=0.0, weight_decay=0.0)
    losses = fit(tmp_path, devices=devices, steps=1, gbs=len(rows), mbs=2, optim=optim,
                 config=tiny_config(seq_length=SEQ, **window), dataset=rows, dump_weights=True,
                 name=name, module_cls=module_cls, **parallel)
    return losses[0], assemble(sorted(tmp_path.glob(f"{name}.end*.pt")))


@pytest.mark.distributed
def test_packed_windowed_batch_equals_one_sample_per_row(tmp_path):
    """Windows apply within each packed sample: loss and updated weights equal those of the
    samples run one per row (plain windowed causal path), at TP=1 and TP=2+SP."""
    data = samples()
    layout = pack(LENGTHS, SEQ)
    packed_rows = [build_row([data[i] for i in row], SEQ, pad_id=0) for row in layout]
    single_rows = [{k: v for k, v in build_row([s], SEQ, pad_id=0).items() if k != "segment_ids"}
                   for s in data]

    ref_loss, ref = run(tmp_path, "reference", single_rows, PretrainModule, WINDOWED)
    full_loss, _ = run(tmp_path, "unwindowed", single_rows, PretrainModule, UNWINDOWED)
    assert abs(full_loss - ref_loss) > 1e-2  # the window changes the loss: it is applied
    for name, devices, parallel in (
        ("packed", 1, {}),
        ("packed_tp2_sp", 2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ):
        loss, got = run(tmp_path, name, packed_rows, SFTModule, WINDOWED, devices, **parallel)
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (name, loss, ref_loss)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=1e-5, msg=f"{name} {key}")
