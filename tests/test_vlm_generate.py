"""Text generation from a vision-language module (objectives/vision_generation.py, through the
KV cache): greedy completions of prompts with 1-2 images equal transformers' own `generate` on the
same model, for Qwen2.5-VL and Qwen3-VL, at TP=1, TP=2 + SP and PP=2, prompts of different lengths
in one batch (the longer prompts' later images reach the cache a column at a time, after the
shortest prompt's prefill); sampled completions are the same at both layouts."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from vlm_models import make_vlm, sample
from lightning_mcore import MegatronStrategy
from lightning_mcore.generation.batched import SamplingSettings
from lightning_mcore.objectives.vision_language import VisionLanguageSFTModule

LAYOUTS = {"tp1": (1, {}), "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
           "pp2": (2, dict(pipeline_model_parallel_size=2))}
NEW = 6


class SaveCompletions(L.Callback):
    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == 0:
            torch.save(outputs, trainer.default_root_dir + "/completions.pt")


def generate(tmp_path, source, prompts: list[dict], sampling: SamplingSettings, layout: str):
    devices, parallel = LAYOUTS[layout]
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        default_root_dir=str(tmp_path), callbacks=[SaveCompletions()],
        strategy=MegatronStrategy(global_batch_size=1, start_method="fork", **parallel))
    loader = DataLoader(prompts, batch_size=len(prompts), collate_fn=lambda xs: {"prompts": xs, "sampling": sampling})
    trainer.predict(VisionLanguageSFTModule(str(source)), loader)
    return torch.load(tmp_path / "completions.pt")


def as_prompt(s: dict) -> dict:
    """A vlm_models sample as the processor's output for one sample."""
    return dict(input_ids=s["ids"], pixel_values=s["pixels"], image_grid_thw=s["grids"])


def hf_generate(model, s: dict) -> list[int]:
    ids = s["input_ids"][None]
    out = model.generate(input_ids=ids, pixel_values=s["pixel_values"], image_grid_thw=s["image_grid_thw"],
                         mm_token_type_ids=(ids == model.config.image_token_id).int(),
                         attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         min_new_tokens=NEW, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_completions_equal_transformers_generate(family, layout, tmp_path):
    source = tmp_path / "source"
    hf = make_vlm(family, source)
    gen = torch.Generator().manual_seed(3)
    # images at 12-17 (prompt 0), 5-8 and 14-17 (prompt 1), 2-7 (prompt 2): the prefill is 10 long
    samples = [sample(hf, [[1, 4, 4]], 30, gen), sample(hf, [[1, 2, 4], [1, 4, 2]], 25, gen),
               sample(hf, [[1, 4, 4]], 10, gen)]
    prompts = [as_prompt(s) for s in samples]
    ours = generate(tmp_path, source, prompts, SamplingSettings(max_new_tokens=NEW, greedy=True), layout)
    with torch.no_grad():
        expected = [hf_generate(hf, p) for p in prompts]
    assert ours == expected


def test_sampled_completions_alike_at_both_layouts(tmp_path):
    source = tmp_path / "source"
    hf = make_vlm("qwen2_5_vl", source)
    prompt = as_prompt(sample(hf, [[1, 4, 4]], 30, torch.Generator().manual_seed(4)))
    sampling = SamplingSettings(max_new_tokens=NEW, temperature=1.0, seed=7)
    runs = [generate(tmp_path / layout, source, [prompt, prompt], sampling, layout) for layout in ("tp1", "tp2_sp")]
    assert runs[0] == runs[1] and runs[0][0] == runs[0][1] and len(runs[0][0]) == NEW
    greedy = generate(tmp_path / "greedy", source, [prompt], SamplingSettings(max_new_tokens=NEW, greedy=True), "tp1")
    assert runs[0][0] != greedy[0], "sampling at temperature 1 gave the greedy completion"


def test_prompts_that_cannot_be_run_are_refused_naming_them():
    from lightning_mcore.objectives.vision_generation import prompt_parts

    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match=r"prompt 2: needs \['image_grid_thw'\]"):
        prompt_parts(dict(input_ids=[1, 2], pixel_values=torch.zeros(16, 8)), 2)
    with pytest.raises(ValueError, match=r"prompt 0: 12 patches for image grids \[\[1, 4, 4\]\] \(16 patches\)"):
        prompt_parts(dict(input_ids=[1, 2], pixel_values=torch.zeros(12, 8), image_grid_thw=grid), 0)
    ids, pixels, grids = prompt_parts(dict(input_ids=torch.tensor([[5, 6, 7]]), pixel_values=torch.zeros(16, 8),
                                           image_grid_thw=grid), 0)  # a processor's batch of one
    assert ids == [5, 6, 7] and pixels.shape == (16, 8) and grids.tolist() == [[1, 4, 4]]
