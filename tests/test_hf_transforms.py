"""HF <-> mcore weight transforms and mapping tables, checked against hand constructions.

Pure and in-process: no process groups, no mcore model. The references are built here by
explicit loops over heads/groups/rows (not by the helpers under test), and the tables are
checked against the tensor names real transformers checkpoints contain.
"""

import json
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_models import FAMILIES as HF_FAMILIES
from hf_models import hf_config_dict, make_hf_model
from lightning_mcore.hf.checkpoint import SafetensorsReader
from lightning_mcore import models
from lightning_mcore.hf.mappings import local_name, shape_symbols
from lightning_mcore.models import gpt_config_from_hf
from lightning_mcore.hf.transforms import (
    QKV,
    Dims,
    GatedQKV,
    GateUp,
    KeyHeadGroups,
    Sections,
    Replicated,
    Split,
    Vocab,
    gate_up_shard,
    gate_up_unshard,
    qkv_merge,
    qkv_split,
)
from lightning_mcore.model.config import GPTConfig


class FakeReader:
    """In-memory `Reader`: serves rows of a dict of tensors and records every read."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors
        self.reads: list[tuple] = []

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def get(self, name, dim=0, start=None, stop=None):
        full = self.tensors[name]
        if start is None and stop is None:
            self.reads.append((name, "all"))
            return full.clone()
        assert 0 <= start <= stop <= full.shape[dim], f"out-of-range read {name}[{start}:{stop}]"
        self.reads.append((name, dim, start, stop))
        return full.narrow(dim, start, stop - start).clone()


def distinct(*shape, base=0.0):
    """A tensor whose every element is different (and different from other bases)."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape) + base


def hand_qkv(q, k, v, heads, groups, head_dim):
    """mcore's fused QKV, row by row: per group its query heads' rows, then its k, then its v."""
    per_group = heads // groups
    rows = []
    for g in range(groups):
        for head in range(g * per_group, (g + 1) * per_group):
            rows += [q[head * head_dim + i] for i in range(head_dim)]
        rows += [k[g * head_dim + i] for i in range(head_dim)]
        rows += [v[g * head_dim + i] for i in range(head_dim)]
    return torch.stack(rows)


def dims(heads=8, groups=2, head_dim=3, vocab=10, padded_vocab=16):
    return Dims(num_heads=heads, num_groups=groups, head_dim=head_dim, vocab=vocab,
                padded_vocab=padded_vocab)


# ---------------------------------------------------------------- QKV
HEADS, HEAD_DIM, HIDDEN = 8, 3, 5


def qkv_tensors(groups, bias=False):
    trailing = () if bias else (HIDDEN,)
    q = distinct(HEADS * HEAD_DIM, *trailing)
    k = distinct(groups * HEAD_DIM, *trailing, base=1000.0)
    v = distinct(groups * HEAD_DIM, *trailing, base=2000.0)
    return q, k, v


@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
@pytest.mark.parametrize("groups", [1, 2, 4, 8])
def test_qkv_merge_is_per_group_interleaved_and_split_inverts_it(groups, bias):
    q, k, v = qkv_tensors(groups, bias)
    fused = qkv_merge(q, k, v, groups)
    expected = hand_qkv(q, k, v, HEADS, groups, HEAD_DIM)
    assert fused.shape == expected.shape == ((HEADS + 2 * groups) * HEAD_DIM, *q.shape[1:])
    assert torch.equal(fused, expected)

    q2, k2, v2 = qkv_split(fused, groups, HEAD_DIM)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_qkv_split_of_arbitrary_fused_tensor_roundtrips():
    fused = torch.randn((HEADS + 2 * 2) * HEAD_DIM, HIDDEN, generator=torch.Generator().manual_seed(0))
    assert torch.equal(qkv_merge(*qkv_split(fused, 2, HEAD_DIM), 2), fused)


@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
@pytest.mark.parametrize("groups,tp", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_qkv_load_reads_only_own_groups_and_shards_concatenate_to_the_merge(groups, tp, bias):
    q, k, v = qkv_tensors(groups, bias)
    names = ("q", "k", "v")
    d = dims(HEADS, groups, HEAD_DIM)
    shards = []
    for rank in range(tp):
        reader = FakeReader(dict(zip(names, (q, k, v))))
        shard = QKV().load(reader, names, rank, tp, d)
        # this rank holds heads/tp query heads and groups/tp key/value heads
        q_rows, kv_rows = HEADS // tp * HEAD_DIM, groups // tp * HEAD_DIM
        assert shard.shape == (q_rows + 2 * kv_rows, *q.shape[1:])
        assert sorted(reader.reads) == sorted([
            ("q", 0, rank * q_rows, (rank + 1) * q_rows),
            ("k", 0, rank * kv_rows, (rank + 1) * kv_rows),
            ("v", 0, rank * kv_rows, (rank + 1) * kv_rows),
        ])
        shards.append(shard)
    assert torch.equal(torch.cat(shards), hand_qkv(q, k, v, HEADS, groups, HEAD_DIM))

    saved = QKV().save(shards, names, d)
    assert saved.keys() == set(names)
    assert torch.equal(saved["q"], q) and torch.equal(saved["k"], k) and torch.equal(saved["v"], v)


# ---------------------------------------------------------------- gate / up
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_rank_shard_is_gate_rows_then_up_rows_of_that_rank(tp):
    ffn, hidden = 8, 3
    gate, up = distinct(ffn, hidden), distinct(ffn, hidden, base=500.0)
    rows = ffn // tp
    shards = []
    for rank in range(tp):
        reader = FakeReader({"gate": gate, "up": up})
        shard = GateUp().load(reader, ("gate", "up"), rank, tp, dims())
        own = range(rank * rows, (rank + 1) * rows)
        expected = torch.stack([gate[i] for i in own] + [up[i] for i in own])
        assert torch.equal(shard, expected)
        assert torch.equal(gate_up_shard(gate, up, rank, tp), expected)
        assert sorted(reader.reads) == [("gate", 0, own.start, own.stop), ("up", 0, own.start, own.stop)]
        shards.append(shard)

    saved = GateUp().save(shards, ("gate", "up"), dims())
    assert saved.keys() == {"gate", "up"}
    assert torch.equal(saved["gate"], gate) and torch.equal(saved["up"], up)
    g, u = gate_up_unshard(shards)
    assert torch.equal(g, gate) and torch.equal(u, up)


# ---------------------------------------------------------------- vocab
@pytest.mark.parametrize("vocab,padded,tp", [
    (16, 16, 2),  # no padding
    (10, 16, 1),
    (10, 16, 2),  # last rank partly padding
    (10, 16, 4),  # one rank partly padding, one entirely
    (200, 512, 4),  # the tiny HF models' vocab at tp=4 (padded to a multiple of 128 x 4)
])
def test_vocab_pads_with_zero_rows_never_reads_past_vocab_and_save_trims(vocab, padded, tp):
    hidden = 3
    emb = distinct(vocab, hidden, base=1.0)  # no zero rows of its own
    d = dims(vocab=vocab, padded_vocab=padded)
    step = padded // tp
    shards = []
    for rank in range(tp):
        reader = FakeReader({"emb": emb})
        shard = Vocab().load(reader, ("emb",), rank, tp, d)
        expected = torch.stack([emb[i] if i < vocab else torch.zeros(hidden)
                                for i in range(rank * step, (rank + 1) * step)])
        assert torch.equal(shard, expected)
        for read in reader.reads:
            assert read[0] == "emb" and read[1] == 0 and read[3] <= vocab, read
            assert read[2] == min(rank * step, vocab)  # starts at its own first row
        shards.append(shard)
    full = torch.cat(shards)
    assert full.shape == (padded, hidden)
    assert not full[vocab:].any()

    saved = Vocab().save(shards, ("emb",), d)
    assert list(saved) == ["emb"] and torch.equal(saved["emb"], emb)


# ---------------------------------------------------------------- split / replicated
@pytest.mark.parametrize("dim,tp", [(0, 1), (0, 2), (0, 4), (1, 1), (1, 2), (1, 3)])
def test_split_loads_contiguous_slices_and_saves_their_concatenation(dim, tp):
    t = distinct(4, 6)
    n = t.shape[dim] // tp
    shards = []
    for rank in range(tp):
        reader = FakeReader({"w": t})
        shard = Split(dim).load(reader, ("w",), rank, tp, dims())
        if dim == 0:
            expected = torch.stack([t[i] for i in range(rank * n, (rank + 1) * n)])
        else:
            expected = torch.stack([t[:, j] for j in range(rank * n, (rank + 1) * n)], dim=1)
        assert torch.equal(shard, expected)
        assert reader.reads == [("w", dim, rank * n, (rank + 1) * n)]
        shards.append(shard)
    assert Split(dim).tp_dim == dim
    saved = Split(dim).save(shards, ("w",), dims())
    assert list(saved) == ["w"] and torch.equal(saved["w"], t)


def test_replicated_gives_every_rank_the_whole_tensor():
    t = distinct(7)
    for rank in range(4):
        reader = FakeReader({"norm": t})
        assert torch.equal(Replicated().load(reader, ("norm",), rank, 4, dims()), t)
        assert reader.reads == [("norm", "all")]
    assert Replicated.tp_dim is None
    saved = Replicated().save([t.clone() for _ in range(4)], ("norm",), dims())
    assert list(saved) == ["norm"] and torch.equal(saved["norm"], t)


def test_safetensors_reader_serves_the_slices_the_transforms_ask_for(tmp_path):
    w, b = distinct(10, 6), distinct(7, base=0.5).to(torch.bfloat16)
    save_file({"w": w, "b": b}, tmp_path / "model.safetensors")
    with SafetensorsReader(tmp_path) as reader:
        assert reader.shape("w") == (10, 6) and reader.shape("b") == (7,)
        assert reader.dtype("w") == "F32" and reader.dtype("b") == "BF16"
        assert torch.equal(reader.get("w"), w) and torch.equal(reader.get("b"), b)
        assert torch.equal(reader.get("w", 0, 2, 5), torch.stack([w[2], w[3], w[4]]))
        assert torch.equal(reader.get("w", 1, 4, 6), torch.stack([w[:, 4], w[:, 5]], dim=1))
        assert torch.equal(reader.get("b", 0, 3, 7), b[3:])
        assert reader.get("w", 0, 10, 10).shape == (0, 6)  # a rank entirely in the vocab padding
        # the transforms read a real file as they read the fake one
        for rank in range(2):
            fake = FakeReader({"w": w})
            assert torch.equal(Vocab().load(reader, ("w",), rank, 2, dims(vocab=10, padded_vocab=16)),
                               Vocab().load(fake, ("w",), rank, 2, dims(vocab=10, padded_vocab=16)))
            assert torch.equal(Split(1).load(reader, ("w",), rank, 2, dims()),
                               Split(1).load(fake, ("w",), rank, 2, dims()))


# ---------------------------------------------------------------- mapping tables
NAMES_PER_TRANSFORM = {QKV: 3, GatedQKV: 3, GateUp: 2, Split: 1, Vocab: 1, Replicated: 1}


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")  # those EXPECTED below covers


# ---------------------------------------------------------------- linear attention, gated q
@pytest.mark.parametrize("groups,tp", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_gated_qkv_shard_holds_each_group_queries_gates_keys_values(groups, tp):
    """HF q_proj rows per head: head_dim query rows, then head_dim gate rows."""
    q_proj = distinct(2 * HEADS * HEAD_DIM, HIDDEN)
    k, v = distinct(groups * HEAD_DIM, HIDDEN, base=1000.0), distinct(groups * HEAD_DIM, HIDDEN, base=2000.0)
    names = ("q", "k", "v")
    d = dims(heads=HEADS, groups=groups, head_dim=HEAD_DIM)
    per_group = HEADS // groups
    shards = []
    for rank in range(tp):
        rows = []
        for g in range(rank * groups // tp, (rank + 1) * groups // tp):
            heads = range(g * per_group, (g + 1) * per_group)
            rows += [q_proj[2 * h * HEAD_DIM + i] for h in heads for i in range(HEAD_DIM)]
            rows += [q_proj[(2 * h + 1) * HEAD_DIM + i] for h in heads for i in range(HEAD_DIM)]
            rows += [k[g * HEAD_DIM + i] for i in range(HEAD_DIM)] + [v[g * HEAD_DIM + i] for i in range(HEAD_DIM)]
        got = GatedQKV().load(FakeReader(dict(zip(names, (q_proj, k, v)))), names, rank, tp, d)
        assert torch.equal(got, torch.stack(rows))
        shards.append(got)
    saved = GatedQKV().save(shards, names, d)
    assert all(torch.equal(saved[n], t) for n, t in zip(names, (q_proj, k, v)))


@pytest.mark.parametrize("tp", [1, 2])
def test_sections_shard_holds_each_sections_rank_slice_in_order(tp):
    """Linear attention's in_proj from Qwen3.5's in_proj_qkv [q; k; v], in_proj_z, _b, _a."""
    qk, v, heads = 4, 6, 2
    tensors = {"qkv": distinct(2 * qk + v, HIDDEN), "z": distinct(v, HIDDEN, base=1000.0),
               "b": distinct(heads, HIDDEN, base=2000.0), "a": distinct(heads, HIDDEN, base=3000.0)}
    names = tuple(tensors)
    t = Sections(((0, 0, qk), (0, qk, qk), (0, 2 * qk, v), (1, 0, v), (2, 0, heads), (3, 0, heads)))
    sections = [tensors["qkv"][:qk], tensors["qkv"][qk:2 * qk], tensors["qkv"][2 * qk:], tensors["z"],
                tensors["b"], tensors["a"]]
    shards = []
    for rank in range(tp):
        want = torch.cat([sec[rank * len(sec) // tp:(rank + 1) * len(sec) // tp] for sec in sections])
        got = t.load(FakeReader(tensors), names, rank, tp, dims())
        assert torch.equal(got, want)
        shards.append(got)
    saved = t.save(shards, names, dims())
    assert saved.keys() == tensors.keys() and all(torch.equal(saved[n], tensors[n]) for n in names)


@pytest.mark.parametrize("tp", [1, 2])
def test_key_head_groups_shard_gathers_each_kind_over_the_ranks_key_heads(tp):
    """Qwen3-Next's in_proj_qkvz = [q_g k_g v_g z_g] and in_proj_ba = [b_g a_g] per key head g."""
    key_heads, dk, per_k, dv = 4, 2, 2, 3  # per_k value heads per key head
    blocks = ((dk, dk, per_k * dv, per_k * dv), (per_k, per_k))
    tensors = {"qkvz": distinct(key_heads * sum(blocks[0]), HIDDEN),
               "ba": distinct(key_heads * sum(blocks[1]), HIDDEN, base=5000.0)}
    names = tuple(tensors)
    t = KeyHeadGroups(key_heads, blocks)
    shards = []
    for rank in range(tp):
        mine = range(rank * key_heads // tp, (rank + 1) * key_heads // tp)
        rows = []
        for name, sizes in zip(names, blocks):
            per = sum(sizes)
            for j, size in enumerate(sizes):  # kind j over this rank's key heads
                first = sum(sizes[:j])
                rows += [tensors[name][g * per + first + i] for g in mine for i in range(size)]
        got = t.load(FakeReader(tensors), names, rank, tp, dims())
        assert torch.equal(got, torch.stack(rows))
        shards.append(got)
    saved = t.save(shards, names, dims())
    assert all(torch.equal(saved[n], tensors[n]) for n in names)


def mapping(family: str, tied: bool):
    return models.weights(GPTConfig(tie_word_embeddings=tied, num_moe_experts=4), family)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", list(HF_FAMILIES))
def test_entries_are_consistent(name, tied):
    cfg, family = gpt_config_from_hf(hf_config_dict(name), tie_word_embeddings=tied)
    entries = models.weights(cfg, family)
    assert len({e.mcore for e in entries}) == len(entries), "an mcore name listed twice"
    symbols = shape_symbols(cfg)
    for e in entries:
        assert len(e.shapes) == len(e.hf), e.mcore
        assert len(e.hf) == NAMES_PER_TRANSFORM.get(type(e.transform), len(e.hf)), e.mcore
        assert all(s in symbols for shape in e.shapes for s in shape), e.mcore
        assert ("{E}" in e.mcore) == e.expert, e.mcore
        # an expert's HF names carry {E}, unless the HF tensor stacks every expert (stacked)
        assert all("{E}" in n for n in e.hf) == (e.expert and not e.stacked), e.mcore
        assert ("{L}" in e.mcore) == all("{L}" in n for n in e.hf), e.mcore


def test_mapping_of_unknown_family_lists_known_ones():
    with pytest.raises(ValueError, match="gpt2.*llama.*qwen3_moe"):
        models.weights(GPTConfig(), "gpt2")


@pytest.mark.parametrize("te,local", [
    ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
     "decoder.layers.3.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
     "decoder.layers.0.pre_mlp_layernorm.weight"),
    ("decoder.layers.1.mlp.experts.linear_fc1.weight3",
     "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"),
    ("decoder.layers.11.mlp.experts.linear_fc2.weight12",
     "decoder.layers.11.mlp.experts.local_experts.12.linear_fc2.weight"),
    # already local names are left alone
    ("decoder.layers.3.self_attention.linear_qkv.weight", "decoder.layers.3.self_attention.linear_qkv.weight"),
    ("decoder.layers.2.mlp.linear_fc1.weight", "decoder.layers.2.mlp.linear_fc1.weight"),
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
])
def test_local_name_translates_te_spec_names(te, local):
    assert local_name(te) == local


L_, H_ = "decoder.layers.3.", "model.layers.7."  # mcore local layer 3 is global HF layer 7
EXPECTED = {  # mcore name -> (layer match, expert match, HF names for global layer 7 / expert 6)
    "embedding.word_embeddings.weight": (None, None, ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": (None, None, ("model.norm.weight",)),
    "output_layer.weight": (None, None, ("lm_head.weight",)),
    L_ + "input_layernorm.weight": ("3", None, (H_ + "input_layernorm.weight",)),
    L_ + "pre_mlp_layernorm.weight": ("3", None, (H_ + "post_attention_layernorm.weight",)),
    L_ + "self_attention.linear_qkv.weight": ("3", None, (
        H_ + "self_attn.q_proj.weight", H_ + "self_attn.k_proj.weight", H_ + "self_attn.v_proj.weight")),
    L_ + "self_attention.linear_qkv.bias": ("3", None, (
        H_ + "self_attn.q_proj.bias", H_ + "self_attn.k_proj.bias", H_ + "self_attn.v_proj.bias")),
    L_ + "self_attention.linear_proj.weight": ("3", None, (H_ + "self_attn.o_proj.weight",)),
    L_ + "self_attention.q_layernorm.weight": ("3", None, (H_ + "self_attn.q_norm.weight",)),
    L_ + "self_attention.k_layernorm.weight": ("3", None, (H_ + "self_attn.k_norm.weight",)),
    L_ + "mlp.linear_fc1.weight": ("3", None, (H_ + "mlp.gate_proj.weight", H_ + "mlp.up_proj.weight")),
    L_ + "mlp.linear_fc2.weight": ("3", None, (H_ + "mlp.down_proj.weight",)),
    L_ + "mlp.router.weight": ("3", None, (H_ + "mlp.gate.weight",)),
    L_ + "mlp.experts.local_experts.2.linear_fc1.weight": ("3", "2", (
        H_ + "mlp.experts.6.gate_proj.weight", H_ + "mlp.experts.6.up_proj.weight")),
    L_ + "mlp.experts.local_experts.2.linear_fc2.weight": ("3", "2", (H_ + "mlp.experts.6.down_proj.weight",)),
}
ATTN = {"input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight"}
DENSE = {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
QK_NORM = {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
MOE = {"mlp.router.weight", "mlp.experts.local_experts.2.linear_fc1.weight",
       "mlp.experts.local_experts.2.linear_fc2.weight"}
IN_FAMILY = {  # which per-layer names of EXPECTED each family's table has
    "llama": ATTN | DENSE,
    "mistral": ATTN | DENSE,
    "qwen2": ATTN | DENSE | {"self_attention.linear_qkv.bias"},
    "qwen3": ATTN | DENSE | QK_NORM,
    "qwen3_moe": ATTN | QK_NORM | MOE,
}


def _in_family(family: str, name: str) -> bool:
    return not name.startswith(L_) or name[len(L_):] in IN_FAMILY[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patterns_match_mcore_names_and_format_hf_names(family):
    entries = mapping(family, tied=False)
    for name, (layer, expert, hf) in EXPECTED.items():
        matches = [(e, m) for e in entries for m in [e.pattern().match(name)] if m]
        if not _in_family(family, name):
            assert not matches, f"{family}: {name} should have no entry"
            continue
        assert len(matches) == 1, f"{family}: {name} matches {len(matches)} entries"
        entry, m = matches[0]
        assert m.groupdict().get("L") == layer and m.groupdict().get("E") == expert
        assert entry.hf_names(layer=7, expert=6) == hf
    # nothing but the whole name matches
    for near in ("decoder.layers.3.self_attention.linear_qkv.weight_extra",
                 "x.decoder.layers.3.self_attention.linear_qkv.weight",
                 "decoder.layers.x.input_layernorm.weight",
                 "decoderXlayers.3.input_layernorm.weight",
                 "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight.main"):
        assert not any(e.pattern().match(near) for e in entries), near


def test_tied_output_layer_reads_the_embedding_and_is_not_exported():
    for family in FAMILIES:
        out = {e.mcore: e for e in mapping(family, tied=True)}["output_layer.weight"]
        assert out.hf == ("model.embed_tokens.weight",) and not out.export
        out = {e.mcore: e for e in mapping(family, tied=False)}["output_layer.weight"]
        assert out.hf == ("lm_head.weight",) and out.export


# ---------------------------------------------------------------- tables vs real checkpoints
def _checkpoint(directory):
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


LINEAR_ATTENTION_PARTS = ("in_proj", "conv1d", "A_log", "dt_bias", "out_norm", "out_proj")


def in_layer(entry, cfg, layer: int) -> bool:
    """Whether `entry` has a parameter in `layer` of a mixed dense/MoE (or linear/full
    attention) stack."""
    moe_part = any(p in entry.mcore for p in (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts."))
    dense_part = ".mlp.linear_fc" in entry.mcore
    if ".self_attention." in entry.mcore and cfg.linear_attention is not None:
        linear_part = entry.mcore.split(".self_attention.")[1].split(".")[0] in LINEAR_ATTENTION_PARTS
        return linear_part == cfg.is_linear_attention_layer(layer)
    return cfg.is_moe_layer(layer) if moe_part else not cfg.is_moe_layer(layer) if dense_part else True


@pytest.mark.parametrize("name", list(HF_FAMILIES))
def test_table_names_exactly_the_tensors_of_a_real_checkpoint(name, tmp_path):
    hf = make_hf_model(name, tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    shapes = _checkpoint(tmp_path)
    cfg, family = gpt_config_from_hf(tmp_path)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings  # llama_tied, gemma3
    config = json.loads((tmp_path / "config.json").read_text())
    symbols = shape_symbols(cfg)

    exported = Counter()  # what export writes: every checkpoint tensor exactly once
    read = set()  # what loading reads
    for entry in models.weights(cfg, family):
        layers = [i for i in range(cfg.num_layers) if in_layer(entry, cfg, i)] if "{L}" in entry.mcore else [None]
        experts = range(cfg.num_moe_experts) if entry.expert else [None]
        for layer in layers:
            for expert in experts:
                names = entry.hf_names(layer, expert)
                read.update(names)
                if entry.export and not (entry.stacked and expert):  # a stacked tensor: written once
                    exported.update(names)
                for n, shape in zip(names, entry.shapes):
                    if n in shapes:
                        assert shapes[n] == tuple(symbols[s] for s in shape), n

    assert read == set(shapes), (f"missing: {sorted(set(shapes) - read)}, "
                                 f"extra: {sorted(read - set(shapes))}")
    assert set(exported) == set(shapes) and set(exported.values()) == {1}
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in read
    # the layer/expert counts the tables were expanded with are the config's own
    assert config["num_hidden_layers"] == cfg.num_layers
    assert f"model.layers.{cfg.num_layers - 1}.input_layernorm.weight" in shapes
