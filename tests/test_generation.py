"""Acceptance (generation, issue 21 part 1): KV-cache greedy generation equals no-cache greedy
decoding (the whole sequence re-run each step) token for token at TP=1, TP=2, PP=2 and for a
Qwen3-MoE at EP=2 and TP=2+SP, with prompts of different lengths in one batch, and equals transformers'
own greedy `generate`; seeded sampling is reproducible and the same at TP=1 and TP=2; stop
tokens end a completion; too-long requests are refused."""

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from hf_models import make_hf_model
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning_mcore import MegatronStrategy, PretrainModule
from lightning_mcore.generation import decode_graphs
from lightning_mcore.generation.batched import SamplingSettings, choose_tokens, generate_batch
from toy import tiny_config

PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 120], [150, 11, 64, 2]]  # different lengths
NEW = 6
SAMPLED = dict(max_new_tokens=NEW, temperature=1.0, top_k=50, top_p=0.9)


def no_cache_greedy(module, prompt: list[int], new: int) -> list[int]:
    """The reference: each new token from the logits of the whole sequence so far."""
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(module.forward_logits(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


class Generate(L.Callback):
    """Every rank generates (collective) and writes what it got and the references. `full`: also
    the sampling, stop-token and single-prompt paths; without it (a family's own cache, whose
    sampling is this file's), only cached greedy decoding against the no-cache reference, over
    all prompts and over each data-parallel rank's own."""

    def __init__(self, out, full: bool = True) -> None:
        self.out, self.full = out, full

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.predicted = outputs  # predict_step on a batch of prompts: greedy completions

    def on_predict_end(self, trainer, pl_module):
        greedy = SamplingSettings(max_new_tokens=NEW, greedy=True)
        got = {
            "greedy": pl_module.generate_batch(PROMPTS, greedy),
            "reference": [no_cache_greedy(pl_module, p, NEW) for p in PROMPTS],
        }
        # Data-parallel ranks with prompts of their own (GRPO's rollouts; other counts and
        # lengths): at EP=2 their experts' all-to-all must still see the same calls.
        from megatron.core import parallel_state as ps
        size, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = [i for i in range(len(PROMPTS)) if i % size == rank]
        got["own_prompts_match"] = (pl_module.generate_batch([PROMPTS[i] for i in mine], greedy)
                                    == [got["reference"][i] for i in mine])
        got["sequence_parallel_after"] = sorted({bool(m.sequence_parallel) for c in pl_module.chunks
                                                 for m in c.modules() if hasattr(m, "sequence_parallel")})
        if self.full:
            got.update(self.sampled(pl_module, greedy, got["greedy"]))
        if pl_module.model_config.moe_routing_replay:
            got["routing_as_eager"] = self.routing_as_eager(pl_module, greedy)
        (self.out.parent / f"{self.out.stem}.rank{trainer.global_rank}.json").write_text(json.dumps(got))

    def routing_as_eager(self, pl_module, greedy: SamplingSettings) -> bool:
        """The experts recorded while decoding (from CUDA graphs on GPU) are those recorded eagerly."""
        from lightning_mcore.generation.batched import generate_traced

        runs = [generate_traced(pl_module._strategy, pl_module.chunks, PROMPTS, pl_module.model_config,
                                SamplingSettings(**{**asdict(greedy), "cuda_graphs": graphs}), routing=True)
                for graphs in (True, False)]
        assert runs[0].routing[0].shape[1] > 0  # MoE layers recorded
        return runs[0].completions == runs[1].completions and all(
            torch.equal(a, b) for a, b in zip(runs[0].routing, runs[1].routing))

    def sampled(self, pl_module, greedy: SamplingSettings, completions: list) -> dict:
        got = {
            "predicted": self.predicted,
            "one": pl_module.generate(PROMPTS[1], NEW),
            "top_k_1": pl_module.generate_batch(PROMPTS, SamplingSettings(**{**SAMPLED, "top_k": 1})),
            "seed1": pl_module.generate_batch(PROMPTS, SamplingSettings(**SAMPLED, seed=1)),
            "seed1_again": pl_module.generate_batch(PROMPTS, SamplingSettings(**SAMPLED, seed=1)),
            "seed2": pl_module.generate_batch(PROMPTS, SamplingSettings(**SAMPLED, seed=2)),
            "eager": pl_module.generate_batch(PROMPTS, SamplingSettings(**{**asdict(greedy), "cuda_graphs": False})),
        }
        kept = decode_graphs._KEPT.get(pl_module.chunks[0])
        got["graphs"] = len(kept.graphs) if kept is not None and kept.rows == len(PROMPTS) else 0
        stop = got["stop_token"] = completions[0][2]
        got["stopped"] = pl_module.generate_batch(PROMPTS, SamplingSettings(**{**asdict(greedy), "stop": [stop]}))
        return got


def run(tmp_path, source: str, devices: int, name: str, accelerator: str = "cpu", full: bool = True,
        overrides=None, precision=None, **parallel) -> dict:
    out = tmp_path / f"{name}.json"
    # a forked child cannot use CUDA once the parent has: GPU ranks start fresh processes
    start_method = "fork" if accelerator == "cpu" else "popen"
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, precision=precision, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[Generate(out, full)],
        strategy=MegatronStrategy(global_batch_size=devices, start_method=start_method, **parallel),
    )
    prompts = {"prompts": PROMPTS, "sampling": SamplingSettings(max_new_tokens=NEW, greedy=True)}
    trainer.predict(PretrainModule(source, model_overrides=overrides or {}), DataLoader([prompts], batch_size=None))
    got = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(devices)]
    assert all(g == got[0] for g in got[1:]), "ranks disagree"
    return got[0]


def hf_greedy(hf) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding)."""
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def check_cache(got: dict) -> None:
    """Cached greedy decoding equals the no-cache reference, all prompts and each rank's own."""
    assert got["greedy"] == got["reference"], got
    assert got["own_prompts_match"]
    assert all(len(c) == NEW for c in got["greedy"])


def check_one_layout(got: dict) -> None:
    check_cache(got)
    assert got["eager"] == got["greedy"]  # CUDA graphs (GPU) or not: the same tokens
    assert got["predicted"] == got["greedy"]
    assert got["one"] == got["reference"][1]
    assert got["top_k_1"] == got["greedy"]  # top-k 1 leaves only the argmax to draw
    assert got["seed1"] == got["seed1_again"]
    assert got["seed1"] != got["seed2"]
    first = got["greedy"][0].index(got["stop_token"])
    assert got["stopped"][0] == got["greedy"][0][: first + 1]  # ends with the stop token
    for stopped, greedy in zip(got["stopped"][1:], got["greedy"][1:]):
        assert stopped == greedy[: greedy.index(got["stop_token"]) + 1 if got["stop_token"] in greedy else None]


@pytest.mark.distributed
def test_kv_cache_generation_matches_no_cache_and_transformers_at_tp1_tp2_pp2(tmp_path):
    source = tmp_path / "llama"
    hf = make_hf_model("llama", source)
    runs = {"tp1": run(tmp_path, str(source), 1, "tp1"),
            "tp2": run(tmp_path, str(source), 2, "tp2", tensor_model_parallel_size=2),
            "pp2": run(tmp_path, str(source), 2, "pp2", pipeline_model_parallel_size=2),
            # sequence parallelism: no cache (a one-token step cannot be split over TP ranks)
            "tp2_sp": run(tmp_path, str(source), 2, "tp2_sp", tensor_model_parallel_size=2,
                          sequence_parallel=True)}
    for name, got in runs.items():
        check_one_layout(got)
    assert runs["tp1"]["greedy"] == hf_greedy(hf)
    for name in ("tp2", "pp2", "tp2_sp"):
        assert runs[name]["greedy"] == runs["tp1"]["greedy"], name
    assert runs["tp2_sp"]["sequence_parallel_after"] == [True]  # switched off for the cache, then back
    assert runs["tp2"]["sequence_parallel_after"] == [False]
    assert runs["tp2"]["seed1"] == runs["tp1"]["seed1"]
    assert runs["tp2"]["seed2"] == runs["tp1"]["seed2"]


@pytest.mark.distributed
def test_kv_cache_generation_matches_no_cache_for_moe_at_ep2_and_tp2_sp(tmp_path):
    source = tmp_path / "qwen3_moe"
    hf = make_hf_model("qwen3_moe", source, num_hidden_layers=2)  # both MoE: each EP=2 layer costs all-to-alls
    want = hf_greedy(hf)
    for name, parallel in (("ep2", dict(expert_model_parallel_size=2)),
                           # the cache with sequence parallelism switched off, MoE layers included
                           ("tp2_sp", dict(tensor_model_parallel_size=2, sequence_parallel=True))):
        got = run(tmp_path, str(source), 2, name, **parallel)
        check_one_layout(got)
        assert got["greedy"] == want, name
    assert got["sequence_parallel_after"] == [True]  # switched back on after generating


def test_sampling_keeps_to_top_k_and_top_p():
    """Draws only from the k most likely tokens / the smallest set holding top_p of the mass."""
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]]).expand(400, 4))
    gen = torch.rand(400, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    top2 = choose_tokens(logits, SamplingSettings(top_k=2), gen)
    assert set(top2.tolist()) == {1, 2}
    top_p = choose_tokens(logits, SamplingSettings(top_p=0.85), gen)  # 0.5 + 0.3 < 0.85: 3 tokens
    assert set(top_p.tolist()) == {1, 2, 3}
    every = choose_tokens(logits, SamplingSettings(), gen)
    assert set(every.tolist()) == {0, 1, 2, 3}
    assert abs((every == 1).double().mean().item() - 0.5) < 0.1
    assert choose_tokens(logits, SamplingSettings(greedy=True), gen).eq(1).all()


def test_too_long_requests_and_bad_settings_are_refused():
    module = PretrainModule(tiny_config(seq_length=16))
    MegatronStrategy(global_batch_size=1).connect(module)
    with pytest.raises(ValueError, match=r"prompt 1 \(10 tokens\) \+ max_new_tokens \(7\) is longer than "
                                         r"the model's seq_length=16; use at most 6 new tokens"):
        module.generate_batch([[1, 2], list(range(10))], SamplingSettings(max_new_tokens=7))
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        generate_batch(module._strategy, None, [[], [1]], module.model_config, SamplingSettings())
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        SamplingSettings(temperature=0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingSettings(top_p=0.0)


@pytest.mark.distributed
@pytest.mark.parametrize("family, parallel", [
    ("qwen3_moe", dict(pipeline_model_parallel_size=2)),
    ("deepseek_v3", dict(expert_model_parallel_size=2)),
    ("deepseek_v3", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ("deepseek_v3", dict(pipeline_model_parallel_size=2)),
], ids=["qwen3_moe-pp2", "deepseek_v3-ep2", "deepseek_v3-tp2_sp", "deepseek_v3-pp2"])
def test_kv_cache_generation_for_moe_at_the_other_layouts(family, parallel, tmp_path):
    """The MoE layouts the test above leaves: PP=2 (a Qwen3-MoE), and a DeepSeek-V3 (latent
    attention, a dense first layer, grouped sigmoid routing) at EP=2, TP=2+SP and PP=2: cached
    greedy decoding equals the no-cache reference and transformers' generate."""
    source = tmp_path / family
    hf = make_hf_model(family, source, **({"num_hidden_layers": 2} if family == "qwen3_moe" else {}))
    got = run(tmp_path, str(source), 2, "layout", full=False, **parallel)
    check_cache(got)
    assert got["greedy"] == hf_greedy(hf)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["deepseek_v3", "gemma3"])
def test_kv_cache_generation_for_latent_attention_and_windows(family, tmp_path):
    """Multi-latent attention (DeepSeek-V3, YaRN); Gemma 3's local RoPE and sliding windows
    (the longest prompt + completion runs past the window of 8)."""
    source = tmp_path / family
    hf = make_hf_model(family, source)
    got = run(tmp_path, str(source), 1, family)
    assert got["greedy"] == got["reference"] == hf_greedy(hf)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kv_cache_generation_on_gpu_with_transformer_engine(tmp_path):
    """The cache on CUDA through the TE spec (TE's attention), fp32, decode steps replayed from
    CUDA graphs: as without a cache, as eager decoding and as transformers (greedy); seeded
    sampling reproducible."""
    source = tmp_path / "llama"
    hf = make_hf_model("llama", source)
    assert PretrainModule(str(source)).model_config.uses_te("gpu")
    got = run(tmp_path, str(source), 1, "gpu", accelerator="gpu")
    check_one_layout(got)
    assert got["graphs"] >= NEW - 1  # one per decoded position, kept for the later calls
    assert got["greedy"] == hf_greedy(hf)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_decode_cuda_graphs_at_tp2_on_gpu(tmp_path):
    """At TP=2 (TE, fp32) the decode steps are captured with the row-parallel all-reduces and the
    logits' all-gather inside: greedy tokens as without a cache, as eager decoding and as
    transformers; seeded sampling reproducible; both ranks the same. With the graphs' memory
    budget spent after one capture, the later positions decode eagerly with the same tokens. Under torchrun (a rank
    started by Lightning from pytest would rerun pytest, with its own tmp_path)."""
    source = tmp_path / "llama"
    hf = make_hf_model("llama", source)
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    str(here / "gpu_decode_tp2_script.py"), str(source), str(tmp_path)],
                   env=env, check=True, timeout=300)
    got = [json.loads((tmp_path / f"tp2.rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1], "ranks disagree"
    check_one_layout(got[0])
    assert got[0]["graphs"] >= NEW - 1  # captured, not the eager fallback
    assert got[0]["greedy"] == hf_greedy(hf)
    # the graphs' memory budget spent by the first capture: the rest eager, the same tokens
    budget = [json.loads((tmp_path / f"budget.rank{r}.json").read_text()) for r in range(2)]
    assert budget[0] == budget[1], "ranks disagree"
    assert budget[0]["graphs"] == 1
    assert budget[0]["greedy"] == got[0]["reference"][:2]


class OutputPositions(L.Callback):
    """The positions (rows of [seq, batch, hidden]) of each forward that reach the output layer
    while the batch's prompts are generated."""

    def __init__(self, out) -> None:
        self.out, self.seen, self.fed = out, [], []

    def on_predict_start(self, trainer, pl_module):
        for chunk in pl_module.chunks:
            for name, module in chunk.named_modules():
                if name.endswith("output_layer"):
                    module.register_forward_hook(lambda m, args, out: self.seen.append(args[0].shape[0]))
                if name.endswith("embedding"):
                    module.register_forward_hook(lambda m, args, out: self.fed.append(out.shape[0]))

    def on_predict_end(self, trainer, pl_module):
        self.out.write_text(json.dumps({"seen": self.seen, "fed": self.fed}))


def test_cached_steps_take_only_the_last_position_to_the_output_layer(tmp_path):
    """mcore runs the static context's inference paths (among them: only each row's last
    position through the output layer) only under its process-wide InferenceMode flag, which
    generation sets: the prefill feeds every prompt position, the output layer sees one."""
    out = tmp_path / "positions.json"
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[OutputPositions(out)], strategy=MegatronStrategy(global_batch_size=1, start_method="fork"),
    )
    prompts = {"prompts": PROMPTS, "sampling": SamplingSettings(max_new_tokens=NEW, greedy=True)}
    trainer.predict(PretrainModule(tiny_config()), DataLoader([prompts], batch_size=None))
    got = json.loads(out.read_text())
    assert len(got["fed"]) == len(got["seen"]) >= NEW - 1
    assert max(got["fed"]) >= min(len(p) for p in PROMPTS) > 1  # a prefill of several positions
    assert set(got["seen"]) == {1}

def test_kept_decode_cache_is_reused_and_sized_to_a_power_of_two():
    """The graphs' KV cache outlives a call: reused while the row count is the same and the
    sequences fit, else replaced (old one dropped); sized to the call's length rounded up to a
    power of two, at most seq_length, not to seq_length."""
    chunk = torch.nn.Linear(2, 2)
    made = []

    def new_context(capacity):
        made.append(capacity)
        return object()

    first = decode_graphs.decode_graphs(chunk, 4, 10, 300, 4096, new_context)
    assert (first.capacity, made) == (512, [512])
    assert decode_graphs.decode_graphs(chunk, 4, 10, 512, 4096, new_context) is first
    assert decode_graphs.decode_graphs(chunk, 4, 10, 20, 4096, new_context) is first
    longer = decode_graphs.decode_graphs(chunk, 4, 10, 513, 4096, new_context)
    assert longer is not first and longer.capacity == 1024
    other_rows = decode_graphs.decode_graphs(chunk, 8, 10, 20, 4096, new_context)
    assert other_rows is not longer and other_rows.capacity == 32
    capped = decode_graphs.decode_graphs(chunk, 8, 10, 3000, 3000, new_context)
    assert capped.capacity == 3000
    assert made == [512, 1024, 32, 3000]
    assert decode_graphs._KEPT[chunk] is capped  # one kept per chunk


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("devices,parallel", [(1, {})], ids=["ep1"])
def test_moe_decode_steps_replay_cuda_graphs_on_gpu(devices, parallel, tmp_path):
    """A Qwen3-MoE's decode steps captured in CUDA graphs (the generation dispatcher: no host
    wait; EP=1, see model/generation_dispatcher.py), in bf16 (torch's grouped GEMM in fp32 copies
    its offsets to the host: not capturable, those steps run eagerly): the same tokens as eager
    decoding, seeded sampling reproducible, and the experts recorded for routing replay (from
    the graphs' static buffers) those recorded eagerly."""
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} GPUs")
    source = tmp_path / "qwen3_moe"
    make_hf_model("qwen3_moe", source, num_hidden_layers=2)
    got = run(tmp_path, str(source), devices, "moe_gpu", accelerator="gpu", precision="bf16-mixed",
              overrides={"moe_routing_replay": True}, **parallel)
    assert got["graphs"] >= NEW - 1
    assert got["eager"] == got["greedy"] == got["predicted"]
    assert got["seed1"] == got["seed1_again"] != got["seed2"]
    assert got["routing_as_eager"]


def test_strategy_teardown_releases_kept_decode_graphs():
    """The kept graphs (and their caches) go with the strategy's teardown, before its process
    groups: a live graph with TP collectives inside makes destroy_process_group hang at exit."""
    chunk = torch.nn.Linear(2, 2)
    decode_graphs.decode_graphs(chunk, 4, 10, 30, 4096, lambda capacity: object())
    assert chunk in decode_graphs._KEPT
    strategy = MegatronStrategy(global_batch_size=1, cluster_environment=LightningEnvironment())
    strategy.accelerator = CPUAccelerator()
    strategy.teardown()
    assert chunk not in decode_graphs._KEPT
