"""Rebuild the tiny vision-language fixtures bundled next to this script.

* ``tiny-qwen2_5-vl/`` and ``tiny-qwen3-vl/``: random tiny models built with transformers' own
  config classes and saved with ``save_pretrained`` (bf16 safetensors, hub-format keys), with
  the files a processor needs: the bundled tokenizer plus the Qwen special tokens, a chat
  template rendering ``{"type": "image"}`` parts as ``<|vision_start|><|image_pad|><|vision_end|>``
  like Qwen's, and an image processor config allowing 4 to 64 merged image tokens per image.
* ``vlm/``: PNGs of a coloured square on grey and ``vlm.jsonl``, chats asking for the colour(s):
  the toy task a tiny VLM must learn (single-image answers are one colour word, multi-image
  answers the colours in order, comma-separated).

Deterministic (seeded); seconds on a CPU::

    python configs/sample_data/make_tiny_vlm.py
"""

import json
import random
import shutil
from pathlib import Path

import torch
from PIL import Image

HERE = Path(__file__).resolve().parent
SEED = 1234
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220),
           "yellow": (230, 220, 40)}
BACKGROUND = (128, 128, 128)
SIZES = {"": (56, 56), "_tall": (56, 84)}  # (width, height): square and non-square grids
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
MIN_TOKENS, MAX_TOKENS = 4, 64  # merged image tokens per image

# Qwen2.5-VL's template (Qwen/Qwen2.5-VL-7B-Instruct), video and vision-id parts kept.
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL's template (Qwen/Qwen3-VL-2B-Instruct) without tools: no default system prompt.
QWEN3_VL_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
    "{%- for item in content -%}{%- if item.type == 'image' or 'image' in item or "
    "'image_url' in item -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'video' or 'video' in item -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item -%}{{ item.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' }}{{ render(message.content) }}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6)
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def tokenizer_files(out: Path, template: str) -> dict:
    """The bundled tokenizer with the Qwen special tokens, EOS ``<|im_end|>`` (a reply's end);
    returns the token ids for config.json."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(HERE / "tokenizer")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    # Written by hand (as make_tokenizer.py does) so transformers 4.x and 5.x read the same.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<pad>",
              "unk_token": "<unk>", "additional_special_tokens": SPECIAL,
              "model_max_length": 2048, "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)
    return {"pad": tok.convert_tokens_to_ids("<pad>"), "size": len(tok), **ids}


def image_processor_file(out: Path, processor_class: str, patch: int, mean, std) -> None:
    factor = patch * VISION["spatial_merge_size"]
    pixels = {"min_pixels": MIN_TOKENS * factor**2, "max_pixels": MAX_TOKENS * factor**2}
    config = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor_class,
              "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "do_convert_rgb": True, "image_mean": mean, "image_std": std,
              "patch_size": patch, "temporal_patch_size": VISION["temporal_patch_size"],
              "merge_size": VISION["spatial_merge_size"], "resample": 3, **pixels,
              "size": {"shortest_edge": pixels["min_pixels"],
                       "longest_edge": pixels["max_pixels"]}}
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def token_ids(ids: dict) -> dict:
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"]}


def vocab(ids: dict) -> int:
    return -(-ids["size"] // 64) * 64  # padded to a multiple of 64, as Qwen's vocabularies are


def build_qwen2_5_vl(out: Path) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer_files(out, QWEN2_5_VL_TEMPLATE)
    text = dict(TEXT, vocab_size=vocab(ids), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["pad"], rope_parameters={
                    "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]})
    vision = dict(VISION, patch_size=14, hidden_act="silu", window_size=56,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **token_ids(ids),
                              tie_word_embeddings=False)
    save(Qwen2_5_VLForConditionalGeneration, config, out)
    image_processor_file(out, "Qwen2_5_VLProcessor", 14, [0.48145466, 0.4578275, 0.40821073],
                         [0.26862954, 0.26130258, 0.27577711])


def build_qwen3_vl(out: Path) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = tokenizer_files(out, QWEN3_VL_TEMPLATE)
    text = dict(TEXT, vocab_size=vocab(ids), bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["pad"], rope_parameters={
                    "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True})
    vision = dict(VISION, patch_size=16, hidden_act="gelu_pytorch_tanh",
                  num_position_embeddings=64, deepstack_visual_indexes=[0])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **token_ids(ids),
                           tie_word_embeddings=False)
    save(Qwen3VLForConditionalGeneration, config, out)
    image_processor_file(out, "Qwen3VLProcessor", 16, [0.5] * 3, [0.5] * 3)


def save(model_class, config, out: Path) -> None:
    torch.manual_seed(SEED)
    model = model_class(config).to(torch.bfloat16).eval()
    model.save_pretrained(out)
    for weights in out.glob("*.safetensors"):
        weights.chmod(0o644)  # save_pretrained writes 0600


def images(out: Path) -> list[str]:
    names = []
    for colour, rgb in COLOURS.items():
        for suffix, (w, h) in SIZES.items():
            image = Image.new("RGB", (w, h), BACKGROUND)
            side = min(w, h) // 2
            left, top = (w - side) // 2, (h - side) // 2
            image.paste(rgb, (left, top, left + side, top + side))
            names.append(f"{colour}{suffix}.png")
            image.save(out / names[-1])
    return names


def records(names: list[str], count: int = 128) -> list[dict]:
    """Single-image questions, one in four with 2 or 3 images; answers name the colours."""
    rng, rows = random.Random(SEED), []
    for k in range(count):
        pictures = rng.sample(names, 1 if k % 4 else rng.choice((2, 3)))
        colours = [p.split(".")[0].split("_")[0] for p in pictures]
        question = ("What colour is the square?" if len(pictures) == 1 else
                    "What colours are the squares, in order?")
        content = [{"type": "image", "image": p} for p in pictures]
        content.append({"type": "text", "text": question})
        rows.append({"messages": [{"role": "user", "content": content},
                                  {"role": "assistant", "content": ", ".join(colours)}]})
    return rows


def build() -> None:
    for name, builder in (("tiny-qwen2_5-vl", build_qwen2_5_vl), ("tiny-qwen3-vl", build_qwen3_vl)):
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        builder(out)
    data = HERE / "vlm"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    rows = records(images(data))
    (data / "vlm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    build()
