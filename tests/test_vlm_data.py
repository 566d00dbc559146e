"""Vision-language chat data: M-RoPE positions, image tokens, patches and grids, packing, bad
inputs, cache.

References are independent of this library: transformers' own ``get_rope_index``, its Qwen-VL
processors and image processors, the chat template rendered by the tokenizer, and the same
samples one per row for packed rows.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from lightning_mcore.data import multimodal
from lightning_mcore.data.mrope_positions import mrope_positions
from lightning_mcore.data.multimodal import ImageOptions, VisionLanguageDataModule
from lightning_mcore.data.vision_processor import load_vision_processor

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "configs" / "sample_data"
VLM = SAMPLE_DIR / "vlm"
MODELS = {"qwen2_5_vl": SAMPLE_DIR / "tiny-qwen2_5-vl", "qwen3_vl": SAMPLE_DIR / "tiny-qwen3-vl"}
QUESTION = "What colour is the square?"


def chat(images, answer, question=QUESTION):
    content = [{"type": "image", "image": i} for i in images] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": answer}]}


def write_data(tmp_path, records, name="data.jsonl"):
    """``records`` as a jsonl file next to copies of the bundled images."""
    folder = tmp_path / "data"
    folder.mkdir(exist_ok=True)
    for png in VLM.glob("*.png"):
        shutil.copy(png, folder / png.name)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(folder / name)


def make(tmp_path, family="qwen3_vl", paths=str(VLM / "vlm.jsonl"), seq_length=128, **kwargs):
    dm = VisionLanguageDataModule(paths, str(MODELS[family]), seq_length,
                                  cache_dir=str(tmp_path / "cache"), **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def hf_rope_index(family, input_ids, grids, image_token_id):
    """transformers' own ``get_rope_index`` of the family's model class, on one sample."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as Model
    model = SimpleNamespace(config=AutoConfig.from_pretrained(MODELS[family]))
    model.get_vision_position_ids = lambda *a, **k: Model.get_vision_position_ids(model, *a, **k)
    ids = torch.as_tensor([input_ids])
    types = (ids == image_token_id).int()
    positions, _ = Model.get_rope_index(model, ids, types, torch.as_tensor(grids))
    return positions[:, 0].numpy()


def sample_of(row, segment):
    where = row["segment_ids"] == segment
    return {"tokens": row["tokens"][where], "labels": row["labels"][where],
            "loss_mask": row["loss_mask"][where], "position_ids": row["position_ids"][:, where]}


# --- M-RoPE positions ---------------------------------------------------------------------


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("grids", [[[1, 4, 6]], [[1, 8, 2], [1, 2, 2]],
                                   [[1, 6, 4], [1, 2, 10], [1, 4, 4]]])
def test_positions_equal_transformers_get_rope_index(family, grids):
    image, merge, rng = 523, 2, np.random.default_rng(len(grids))
    ids = list(rng.integers(5, 500, 3))
    for t, h, w in grids:
        ids += [520] + [image] * (t * h * w // merge**2) + [521] + list(rng.integers(5, 500, 4))
    ours = mrope_positions(ids, np.asarray(grids), image, merge, video_token_id=524)
    np.testing.assert_array_equal(ours, hf_rope_index(family, ids, grids, image))


@pytest.mark.parametrize("family", MODELS)
def test_row_positions_equal_get_rope_index_per_sample(tmp_path, family):
    dm = make(tmp_path, family, seq_length=256)
    rows = dm.train_dataset
    checked = 0
    for r in range(8):
        row, grids_left = rows[r], rows[r]["image_grid_thw"].tolist()
        for segment in range(1, int(row["segment_ids"].max()) + 1):
            sample = sample_of(row, segment)
            n = int((sample["tokens"] == 523).sum())
            grids = []
            while sum(t * h * w // 4 for t, h, w in grids) < n:
                grids.append(grids_left.pop(0))
            ref = hf_rope_index(family, sample["tokens"].tolist(), grids, 523)
            np.testing.assert_array_equal(sample["position_ids"].numpy(), ref)
            checked += len(grids) > 1
    assert checked, "no multi-image sample among the rows checked"


def test_videos_are_refused():
    with pytest.raises(NotImplementedError, match="video"):
        mrope_positions([1, 524, 524, 2], np.zeros((0, 3)), 523, 2, video_token_id=524)


# --- tokens, labels, images ---------------------------------------------------------------


@pytest.mark.parametrize("family", MODELS)
def test_sample_equals_processor_of_rendered_chat(tmp_path, family):
    """One sample per row: its tokens are the processor's output for the chat template's text,
    its loss falls on the reply and end of turn, its patches and grids are the image
    processor's for its images in order."""
    record = chat(["red_tall.png", "blue.png", "green_tall.png"], "red, blue, green")
    dm = make(tmp_path, family, write_data(tmp_path, [record]), packing=False, seq_length=256)
    row = dm.train_dataset[0]
    tok = AutoTokenizer.from_pretrained(MODELS[family])
    text = tok.apply_chat_template(record["messages"], tokenize=False)
    images = [Image.open(VLM / p["image"]) for p in record["messages"][0]["content"][:3]]
    expected = load_vision_processor(str(MODELS[family]))(text, images)
    n = expected["input_ids"].shape[1]
    assert row["tokens"][:n].tolist() == expected["input_ids"][0].tolist()
    assert (row["segment_ids"][:n] == 1).all() and (row["segment_ids"][n:] == 0).all()
    targets = row["labels"][row["loss_mask"] > 0].tolist()
    assert tok.decode(targets) == "red, blue, green<|im_end|>\n"
    reference = AutoImageProcessor.from_pretrained(MODELS[family])(images, return_tensors="np")
    np.testing.assert_array_equal(row["image_grid_thw"].numpy(), reference["image_grid_thw"])
    np.testing.assert_array_equal(row["pixel_values"].numpy(), reference["pixel_values"])
    assert len({tuple(g) for g in row["image_grid_thw"].tolist()}) == 2  # order matters here


def test_parquet_parts_are_structs_with_nulls(tmp_path):
    """In parquet, Arrow stores the parts as structs whose absent fields are null (a text part
    gets "image": None): those must not read as images."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    record = chat(["red.png"], "red")
    record["messages"][1]["content"] = [{"type": "text", "text": "red"}]
    path = Path(write_data(tmp_path, [])).with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist([record] * 2), path)
    dm = make(tmp_path, "qwen2_5_vl", paths=str(path), packing=False)
    assert dm.stats["dropped"] == {} and dm.stats["train"]["images"] == 2
    tok = AutoTokenizer.from_pretrained(MODELS["qwen2_5_vl"])
    row = dm.train_dataset[0]
    assert int((row["tokens"] == 523).sum()) == 4
    assert tok.decode(row["labels"][row["loss_mask"] > 0]) == "red<|im_end|>\n"


def test_packed_rows_equal_one_sample_per_row(tmp_path):
    packed = make(tmp_path, seq_length=128)
    single = make(tmp_path, seq_length=128, packing=False)
    assert len(packed.train_dataset) < len(single.train_dataset)
    where = {row[0]: k for k, row in enumerate(single.train_dataset.rows)}
    several = 0
    for r, samples in enumerate(packed.train_dataset.rows):
        row = packed.train_dataset[r]
        patches = []
        for segment, index in enumerate(samples, 1):
            alone = single.train_dataset[where[index]]
            n = int((alone["segment_ids"] > 0).sum())
            for key, value in sample_of(row, segment).items():
                torch.testing.assert_close(value, sample_of(alone, 1)[key], rtol=0, atol=0)
            assert len(sample_of(row, segment)["tokens"]) == n
            patches.append(alone["pixel_values"])
        torch.testing.assert_close(row["pixel_values"], torch.cat(patches), rtol=0, atol=0)
        several += len(samples) > 1
    assert several > 10


def test_batches_pad_patches_and_grids(tmp_path):
    dm = make(tmp_path)
    strategy = SimpleNamespace(data_parallel_batch_size=4,
                               distributed_sampler_kwargs={"num_replicas": 1, "rank": 0})
    dm.trainer = SimpleNamespace(strategy=strategy, global_step=0)
    batch = next(iter(dm.train_dataloader()))
    assert list(batch) == ["tokens", "labels", "loss_mask", "segment_ids", "position_ids",
                           "pixel_values", "image_grid_thw"]
    B, S = batch["tokens"].shape
    assert batch["position_ids"].shape == (B, 3, S) and batch["position_ids"].dtype == torch.int64
    assert batch["pixel_values"].dtype == torch.float32
    for b in range(B):
        grids = batch["image_grid_thw"][b]
        real = grids[grids.prod(dim=1) > 0]
        patches = int(real.prod(dim=1).sum())
        assert int((batch["tokens"][b] == 523).sum()) == patches // 4
        assert (batch["pixel_values"][b, patches:] == 0).all()
        assert (grids[len(real):] == 0).all()
        assert batch["pixel_values"][b, :patches].abs().sum(dim=1).gt(0).all()


def test_max_image_tokens_resizes_like_the_image_processor(tmp_path):
    dm = make(tmp_path, "qwen2_5_vl", write_data(tmp_path, [chat(["red_tall.png"], "red")]),
              images=ImageOptions(max_image_tokens=4), seq_length=256)
    row = dm.train_dataset[0]
    reference = AutoImageProcessor.from_pretrained(
        MODELS["qwen2_5_vl"], min_pixels=4 * 28 * 28, max_pixels=4 * 28 * 28
    )(Image.open(VLM / "red_tall.png"), return_tensors="np")
    np.testing.assert_array_equal(row["image_grid_thw"].numpy(), reference["image_grid_thw"])
    n = int((row["tokens"] == 523).sum())
    assert n == int(reference["image_grid_thw"].prod()) // 4 and n <= 4 < 6  # 6 without a budget


# --- bad inputs ---------------------------------------------------------------------------


def bad_records(tmp_path):
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image at all")
    big = Image.new("RGB", (200, 200), (255, 0, 0))
    big.save(tmp_path / "data" / "big.png")
    return [
        chat(["red.png"], "red"),
        chat(["missing.png"], "red"),
        chat(["broken.png"], "red"),
        chat(["big.png"], "red"),
        chat(["red.png"], "red", question="What colour is <|image_pad|> this?"),
    ]


@pytest.mark.parametrize("index, message", [
    (1, r"data.jsonl, sample 1: image 'missing.png' not found"),
    (2, r"data.jsonl, sample 2: image 'broken.png' \(.*broken.png\) cannot be read"),
    (3, r"data.jsonl, sample 3: image 'big.png' has 200x200 = 40000 pixels, over max_pixels"),
    (4, r"data.jsonl, sample 4: the chat template renders 2 image tokens for 1 images"),
])
def test_bad_sample_is_refused_naming_it(tmp_path, index, message):
    records = bad_records(tmp_path)
    path = write_data(tmp_path, [records[0], records[index]])
    with pytest.raises(ValueError, match=message.replace("sample " + str(index), "sample 1")):
        make(tmp_path, paths=path, images={"max_pixels": 100 * 100})


def test_bad_samples_dropped_and_counted(tmp_path):
    path = write_data(tmp_path, bad_records(tmp_path))
    dm = make(tmp_path, paths=path, images={"max_pixels": 100 * 100, "bad_samples": "drop"})
    assert dm.stats["dropped"] == {
        "image file not found": 1, "image file unreadable": 1,
        "image over max_pixels=10000": 1, "image tokens do not match the images": 1,
    }
    assert [m.split(":")[0].rsplit(", ", 1)[1] for m in dm.stats["bad_samples"]] == [
        "sample 1", "sample 2", "sample 3", "sample 4"]
    assert dm.stats["train"]["samples"] == 1


def test_images_are_never_cut_by_seq_length(tmp_path):
    long_text = "a long question that goes on " * 6
    later = [{"role": "user", "content": long_text}, {"role": "assistant", "content": "ok"}]
    first = chat(["red_tall.png"], "red")  # its image is early: truncating cuts text only
    first["messages"] += later
    second = chat(["red.png"], "red")  # its image comes late
    second["messages"][0]["content"].insert(0, {"type": "text", "text": long_text})
    second["messages"][:0] = [{"role": "user", "content": "hi"}, later[1]]
    records = [chat(["red.png"], "red"), first, second]
    path = write_data(tmp_path, records)
    tok = AutoTokenizer.from_pretrained(MODELS["qwen3_vl"])
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in records]
    lengths = [len(ids) for ids in tok(texts)["input_ids"]]
    seq = 60
    assert lengths[0] + 3 < seq < min(lengths[1:])  # + 3: image tokens beyond the placeholder
    dm = make(tmp_path, paths=path, seq_length=seq, truncation="truncate")
    assert dm.stats["truncated"] == 1
    assert dm.stats["dropped"] == {f"image tokens cut by seq_length={seq}": 1}
    row = dm.train_dataset.rows.index([1])
    assert int((dm.train_dataset[row]["tokens"] == 523).sum()) == 6  # the whole image
    dm = make(tmp_path, paths=path, seq_length=seq)
    assert dm.stats["dropped"] == {f"longer than seq_length={seq}": 2}
    with pytest.raises(ValueError, match="'an image longer than seq_length=5': 1"):
        make(tmp_path, paths=path, seq_length=5, truncation="truncate")  # red_tall: 6 tokens


def test_video_parts_are_refused(tmp_path):
    record = chat(["red.png"], "red")
    record["messages"][0]["content"][0] = {"type": "video", "video": "clip.mp4"}
    with pytest.raises(NotImplementedError, match="sample 0, message 0, part 0: videos"):
        make(tmp_path, paths=write_data(tmp_path, [record]))


# --- cache --------------------------------------------------------------------------------


def test_second_setup_reads_the_cache(tmp_path, monkeypatch):
    first = make(tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("processed again instead of read from the cache")

    monkeypatch.setattr(multimodal, "_process_batch", fail)
    second = make(tmp_path)
    torch.testing.assert_close(second.train_dataset[3], first.train_dataset[3])
    with pytest.raises(AssertionError, match="processed again"):
        make(tmp_path, images={"max_image_tokens": 4})  # another budget: not the same cache


# --- the processor without torchvision ----------------------------------------------------


TEXT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and "
        "<|vision_start|><|image_pad|><|vision_end|>?<|im_end|>\n")


def compare(ours, theirs):
    for key in ("input_ids", "pixel_values", "image_grid_thw"):
        np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]))


@pytest.mark.parametrize("family", MODELS)
def test_fallback_equals_the_transformers_processor_class(family, monkeypatch):
    """The family's processor class built around the same image processor and tokenizer (its
    class check skipped: it wants the torchvision video processor)."""
    from transformers.processing_utils import ProcessorMixin

    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor as P
    else:
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor as P
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda s, n, a: a)
    ours = load_vision_processor(str(MODELS[family]))
    theirs = P(image_processor=ours.image_processor, tokenizer=ours.tokenizer)
    images = [Image.open(VLM / "red_tall.png"), Image.open(VLM / "blue.png")]
    compare(ours(TEXT, images), theirs(text=[TEXT], images=images, return_tensors="np"))


@pytest.mark.parametrize("family", MODELS)
def test_fallback_equals_auto_processor(family):
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(MODELS[family])
    ours = load_vision_processor(str(MODELS[family]))
    ours.processor = None  # the fallback path, with the PIL image processor
    ours.image_processor = AutoImageProcessor.from_pretrained(MODELS[family], backend="pil")
    images = [Image.open(VLM / "red_tall.png"), Image.open(VLM / "blue.png")]
    theirs = processor(text=[TEXT], images=images, return_tensors="np")
    np.testing.assert_array_equal(ours(TEXT, images)["input_ids"], theirs["input_ids"])
    np.testing.assert_array_equal(ours(TEXT, images)["image_grid_thw"], theirs["image_grid_thw"])
    np.testing.assert_allclose(ours(TEXT, images)["pixel_values"], theirs["pixel_values"],
                               atol=2e-2)  # torchvision and PIL resize a little differently
