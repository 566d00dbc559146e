"""Acceptance (vision-language, issue 24): our Qwen2.5-VL / Qwen3-VL / Qwen3.5 (-MoE) logits on rows with 1-3
images per sample equal transformers' within 1e-4 (fp32) at TP=1, TP=2 + SP and PP=2, also for
two samples packed in one row; the export is bit-identical to the source checkpoint."""

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from test_hf_roundtrip import tensors
from vlm_models import batch, hf_logits, make_vlm, sample
from lightning_mcore import MegatronStrategy
from lightning_mcore.objectives.vision_language import VisionLanguageSFTModule

LAYOUTS = {"tp1": (1, {}), "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
           "pp2": (2, dict(pipeline_model_parallel_size=2))}
SEQ = 48


class SaveLogitsAndExport(L.Callback):
    def __init__(self, out) -> None:
        self.out = out

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == 0:
            torch.save(outputs, self.out / "logits.pt")

    def on_predict_end(self, trainer, pl_module):
        pl_module.save_hf_checkpoint(self.out / "export")


def run(tmp_path, source, data: dict, layout: str):
    devices, parallel = LAYOUTS[layout]
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=MegatronStrategy(global_batch_size=len(data["tokens"]), start_method="fork", **parallel),
        callbacks=[SaveLogitsAndExport(tmp_path)])
    rows = [{k: v[i] for k, v in data.items()} for i in range(len(data["tokens"]))]
    trainer.predict(VisionLanguageSFTModule(str(source)), DataLoader(rows, batch_size=len(rows)))
    return torch.load(tmp_path / "logits.pt")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_export(family, layout, tmp_path):
    check_logits_and_export(family, layout, tmp_path)


def test_published_mtp_layer_of_qwen3_5_is_carried_to_the_export(tmp_path):
    """The published Qwen3.5 checkpoints (vision-language) hold an MTP layer (mtp.*): it loads
    nowhere and the export holds it bit for bit (the export check compares every tensor)."""
    from test_family_qwen3_5 import add_mtp_layer

    check_logits_and_export("qwen3_5", "pp2", tmp_path, prepare=add_mtp_layer)


def check_logits_and_export(family, layout, tmp_path, prepare=None):
    source = tmp_path / "source"
    hf = make_vlm(family, source)
    if prepare is not None:
        prepare(source)
    gen = torch.Generator().manual_seed(1)
    # grids in patches (multiples of the merge size 2); Qwen2.5-VL's windows are 2x2 merged tokens
    one = sample(hf, [[1, 4, 4]], SEQ, gen)
    two = sample(hf, [[1, 4, 4], [1, 4, 6]], SEQ, gen)
    three = sample(hf, [[1, 2, 2], [1, 2, 4], [1, 4, 2]], SEQ, gen)
    half_a, half_b = sample(hf, [[1, 2, 4]], SEQ // 2, gen), sample(hf, [[1, 4, 2], [1, 2, 2]], SEQ // 2, gen)
    rows = [[one], [two], [three], [half_a, half_b]]
    logits = run(tmp_path, source, batch(hf, rows), layout)

    expected = torch.stack([hf_logits(hf, one), hf_logits(hf, two), hf_logits(hf, three),
                            torch.cat([hf_logits(hf, half_a), hf_logits(hf, half_b)])])
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-4

    original, written = tensors(source), tensors(tmp_path / "export")
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    config = json.loads((source / "config.json").read_text())
    assert json.loads((tmp_path / "export" / "config.json").read_text()) == config
    if prepare is not None:
        assert any(name.startswith("mtp.") for name in written)


def test_export_without_the_vision_encoder_is_refused(tmp_path):
    """An export whose model lacks the vision encoder (never attached) is refused, not written
    with the encoder missing (transformers would fill it with random weights)."""
    from lightning_mcore import models
    from lightning_mcore.hf.export import _refuse_incomplete

    make_vlm("qwen2_5_vl", tmp_path)
    cfg, family = models.gpt_config_from_hf(tmp_path)
    table = models.weights(cfg, family)
    decoder_only = [(None, 0, e.hf_names(0, 0), None, None) for e in table if not e.mcore.startswith("visual.")]
    with pytest.raises(RuntimeError, match=r"no parameter for \d+ tensor\(s\).*visual\."):
        _refuse_incomplete(table, decoder_only)
    _refuse_incomplete(table, decoder_only + [(None, 0, e.hf_names(), None, None) for e in table
                                              if e.mcore.startswith("visual.")])


def test_hub_config_layout_reads_as_transformers_5_layout():
    """Qwen2.5-VL-7B-Instruct's config.json on the hub is transformers 4's flat layout
    (rope_scaling type mrope); it gives the same model as transformers 5's nested layout."""
    import transformers

    from lightning_mcore import models

    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
            "max_position_embeddings": 128000, "num_attention_heads": 28, "num_hidden_layers": 28,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": False,
            "vocab_size": 152064, "image_token_id": 151655, "video_token_id": 151656,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                              "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                              "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                              "temporal_patch_size": 2}}
    nested = transformers.Qwen2_5_VLConfig.from_dict(dict(flat)).to_dict()
    assert "text_config" in nested and "rope_scaling" not in flat["vision_config"]
    a, family = models.gpt_config_from_hf(flat)
    b, _ = models.gpt_config_from_hf(nested)
    assert family == "qwen2_5_vl" and a == b
    assert a.mrope.section == [16, 24, 24] and not a.mrope.interleaved and a.add_qkv_bias
    assert a.num_query_groups == 4 and a.rotary_base == 1e6 and a.vision.image_token_id == 151655
