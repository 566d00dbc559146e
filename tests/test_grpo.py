"""Acceptance (GRPO): on a fixed rollout the loss and the weights after SGD steps equal a hand
computation from transformers' logits (token- and sequence-level normalization, beta > 0, a
reused rollout with clipped ratios); TP=2 and PP=2 equal TP=1; mistakes refused with clear
messages; the built-in rewards; the prompt data."""

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from hf_models import make_hf_model
from lightning_mcore import GRPOSampling, LoRAConfig, MegatronStrategy, OptimizerSettings
from lightning_mcore.objectives.grpo import GRPOModule, Rollout
from lightning_mcore.objectives.grpo_loss import group_advantages, normalized, token_terms
from lightning_mcore.rewards import boxed_answer, contains_number, format_reward
from toy import tiny_config

ROOT = Path(__file__).parents[1]
SEQ, G = 32, 4


def fixed_rollout(prompts: int, vocab: int, seed: int = 0) -> Rollout:
    """`prompts` random prompts with G random completions each and random rewards."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids, completion_ids = [], []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(G):
            n = int(torch.randint(2, 12, (1,), generator=gen))
            prompt_ids.append(prompt)
            completion_ids.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    rewards = torch.randint(0, 4, (prompts * G,), generator=gen).double()
    return Rollout(prompt_ids, completion_ids, rewards)


class FixedRollout(GRPOModule):
    """GRPO on a given rollout: the seam below generation."""

    def __init__(self, *args, rollout: Rollout, **kwargs):
        super().__init__(*args, **kwargs)
        self.fixed, self.rollouts_made = rollout, 0

    def make_rollout(self, batch):
        """This data-parallel rank's share of the fixed rollout (whole groups)."""
        self.rollouts_made += 1
        strategy, r = self._strategy(), self.fixed
        n = len(r.prompt_ids) // strategy.data_parallel_size
        mine = slice(strategy.data_parallel_rank * n, (strategy.data_parallel_rank + 1) * n)
        return Rollout(r.prompt_ids[mine], r.completion_ids[mine], r.rewards[mine].clone())


class Record(L.Callback):
    def __init__(self, out: Path, export: bool = False) -> None:
        self.out, self.export, self.rows = out, export, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.rows.append({k: float(trainer.callback_metrics[f"train/{k}"])
                          for k in ("loss", "kl", "clip_fraction")})
        if self.export:
            pl_module.save_hf_checkpoint(self.out.parent / f"policy{trainer.global_step}")

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"rows": self.rows, "rollouts": pl_module.rollouts_made}))


def run(tmp_path, name, model, rollout, optim, steps=2, devices=1, export=False, **kwargs):
    """`steps` optimizer steps on `rollout` with fork-launched ranks; rank 0's record."""
    parallel = {k: kwargs.pop(k) for k in list(kwargs) if k.endswith("parallel_size")}
    out = tmp_path / name / "metrics.json"
    out.parent.mkdir()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Record(out, export)],
        strategy=MegatronStrategy(global_batch_size=len(rollout.prompt_ids), micro_batch_size=4,
                                  start_method="fork", **parallel),
    )
    module = FixedRollout(model, optim, rollout=rollout, num_generations=G, max_completion_length=16, **kwargs)
    trainer.fit(module, DataLoader([0] * steps, batch_size=1))
    return json.loads(out.read_text())


# ------------------------------------------------------------------ the hand computation
def hf_completion_logps(model, rollout: Rollout) -> list[torch.Tensor]:
    """Each prompt + completion alone through transformers: log-probs of the completion tokens."""
    out = []
    for prompt, completion in zip(rollout.prompt_ids, rollout.completion_ids):
        ids = torch.tensor(prompt + completion)
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float()[:-1], -1)
        out.append(logp.gather(-1, ids[1:, None])[:, 0][len(prompt) - 1:])
    return out


def hand_loss(policy, old, ref, rollout, how, beta, eps_low, eps_high, scale=True):
    """GRPO's loss written out sequence by sequence (independent of grpo_loss.py)."""
    rewards = rollout.rewards.reshape(-1, G)
    adv = rewards - rewards.mean(1, keepdim=True)
    if scale:
        adv = adv / (rewards.std(1, keepdim=True) + 1e-4)
    adv = adv.reshape(-1).float()
    per_seq, tokens, clipped = [], 0, 0.0
    for i, logp in enumerate(policy):
        ratio = torch.exp(logp - old[i])
        surrogate = torch.min(ratio * adv[i], torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv[i])
        d = ref[i] - logp
        per_seq.append(-surrogate + beta * (torch.exp(d) - d - 1))
        tokens += len(logp)
        clipped += float((((ratio < 1 - eps_low) & (adv[i] < 0)) | ((ratio > 1 + eps_high) & (adv[i] > 0))).sum())
    if how == "token":
        loss = torch.cat(per_seq).sum() / tokens
    else:
        loss = torch.stack([s.mean() for s in per_seq]).mean()
    return loss, clipped / tokens


def hf_step(model, rollout, old, ref, how, beta, eps_low, eps_high, scale=True):
    """(loss, clip fraction, {name: gradient}) of the hand loss at `model`'s weights."""
    model.zero_grad()
    loss, clip = hand_loss(hf_completion_logps(model, rollout), old, ref, rollout, how, beta, eps_low, eps_high, scale)
    loss.backward()
    return float(loss), clip, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.parametrize("how, beta, iterations, scale, lora", [
    ("token", 0.1, 2, True, False), ("sequence", 0.3, 1, False, False), ("token", 0.2, 1, True, True)])
def test_grpo_matches_hand_computation_from_transformers(tmp_path, how, beta, iterations, scale, lora):
    """Two SGD steps (momentum 0.9, as mcore's SGD) on a fixed rollout. Step 2 meets a changed
    policy: the KL term is live, and with num_iterations=2 the ratio to the sampling policy
    (step 0's weights) is clipped on some tokens. With LoRA the reference is the base with its
    adapters off (taken again for the second rollout, after the adapters moved), and the losses
    are compared (the weights move through the adapters)."""
    source = tmp_path / "source"
    make_hf_model("llama", source)
    rollout = fixed_rollout(2, 200, seed=3)
    lr, eps_low, eps_high = 2.0, 0.05, 0.08
    optim = OptimizerSettings(lr=lr, optimizer="sgd", clip_grad=0.0, weight_decay=0.0, warmup_steps=0,
                              decay_style="constant")
    got = run(tmp_path, "run", str(source), rollout, optim, export=True, model_overrides={"seq_length": SEQ},
              beta=beta, epsilon_low=eps_low, epsilon_high=eps_high, loss_normalization=how,
              num_iterations=iterations, scale_advantages=scale,
              lora=LoRAConfig(rank=4, alpha=8.0) if lora else None)
    assert got["rollouts"] == 3 - iterations  # a rollout is reused for num_iterations steps

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    policy0, policy1, policy2 = load(source), load(tmp_path / "run" / "policy1"), load(tmp_path / "run" / "policy2")
    with torch.no_grad():
        ref = hf_completion_logps(policy0, rollout)
        old1 = ref
        old2 = ref if iterations == 2 else hf_completion_logps(policy1, rollout)
    terms = (how, beta, eps_low, eps_high, scale)
    loss1, _, grad1 = hf_step(policy0, rollout, old1, ref, *terms)
    loss2, clip2, grad2 = hf_step(policy1, rollout, old2, ref, *terms)

    (step1, step2) = got["rows"]
    assert abs(step1["loss"] - loss1) <= 1e-5 * max(1.0, abs(loss1)), (step1, loss1)
    assert step1["kl"] == 0.0 and step1["clip_fraction"] == 0.0
    assert abs(step2["loss"] - loss2) <= 1e-5 * max(1.0, abs(loss2)), (step2, loss2)
    assert step2["kl"] > 1e-4, "the policy did not move away from the reference"
    assert abs(step2["clip_fraction"] - clip2) <= 1e-6
    if iterations == 2:
        assert clip2 > 0, "no ratio clipped: the test would not check the clip"
    if lora:
        return

    weights0 = dict(policy0.named_parameters())
    scale_g = max(float(g.abs().max()) for g in grad1.values())
    for name, w1 in policy1.named_parameters():
        want1 = weights0[name].detach() - lr * grad1[name]
        assert (w1.detach() - want1).abs().max() <= 1e-5 * lr * max(1.0, scale_g), ("step 1", name)
    for name, w2 in policy2.named_parameters():
        want2 = dict(policy1.named_parameters())[name].detach() - lr * (0.9 * grad1[name] + grad2[name])
        assert (w2.detach() - want2).abs().max() <= 1e-5 * lr * max(1.0, scale_g), ("step 2", name)


@pytest.mark.distributed
def test_grpo_layouts_agree(tmp_path):
    """TP=2, PP=2 and DP=2 (a group per rank; the token count is global) equal TP=1 on a fixed
    rollout: SGD, 3 steps, a reused rollout with the frozen-copy reference; and with LoRA (the
    reference: adapters off), TP=2 equals TP=1."""
    rollout = fixed_rollout(2, 500, seed=5)
    optim = OptimizerSettings(lr=0.5, optimizer="sgd", clip_grad=0.0, weight_decay=0.0, warmup_steps=0)
    kwargs = dict(beta=0.2, epsilon_low=0.1, epsilon_high=0.2, num_iterations=2, steps=3)
    config = tiny_config(seq_length=SEQ)
    lora = dict(kwargs, lora=LoRAConfig(rank=4, alpha=8.0), num_iterations=1)
    runs = {name: [r["loss"] for r in run(tmp_path, name, config, rollout, optim, devices=d, **k, **p)["rows"]]
            for name, d, k, p in (("tp1", 1, kwargs, {}), ("tp2", 2, kwargs, dict(tensor_model_parallel_size=2)),
                                  ("pp2", 2, kwargs, dict(pipeline_model_parallel_size=2)),
                                  ("dp2", 2, kwargs, {}),
                                  ("lora_tp1", 1, lora, {}),
                                  ("lora_tp2", 2, lora, dict(tensor_model_parallel_size=2)))}
    assert len(set(runs["tp1"])) == 3 and len(set(runs["lora_tp1"])) == 3, runs
    for name, base in (("tp2", "tp1"), ("pp2", "tp1"), ("dp2", "tp1"), ("lora_tp2", "lora_tp1")):
        assert len(runs[name]) == len(runs[base]) == 3, runs
        for got, want in zip(runs[name], runs[base]):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, runs[name], runs[base])


# ------------------------------------------------------------------ pure functions
def test_advantages_and_token_terms_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    want = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1
    assert torch.allclose(adv[:2], torch.tensor(want), atol=1e-6) and torch.all(adv[4:] == 0)
    assert torch.allclose(group_advantages(rewards, 4, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))

    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.5, -2.0, -0.1]])  # ratios e^0.5 (clipped above), 1, e^-0.4
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    terms = token_terms(logp, old, torch.tensor([2.0]), 0.2, 0.3, beta=0.5, ref_logp=ref)
    k3 = [math.exp(d) - d - 1 for d in (0.0, 1.0, -0.5)]
    ratios = [math.exp(0.5), 1.0, math.exp(-0.4)]
    surrogate = [min(r * 2, min(max(r, 0.8), 1.3) * 2) for r in ratios]
    want = torch.tensor([[-s + 0.5 * k for s, k in zip(surrogate, k3)]])
    assert torch.allclose(terms.loss, want, atol=1e-6)
    assert terms.clipped.tolist() == [[1.0, 0.0, 0.0]]  # e^-0.4 < 0.8 but the advantage is > 0

    values, mask = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert [float(x) for x in normalized(values, mask, "token")] == [7.0, 3.0]
    assert [float(x) for x in normalized(values, mask, "sequence")] == [1.5 + 4.0, 2.0]


def test_builtin_rewards():
    completions = ["so it is \\boxed{1,000}.", "I think 12 then 14", "no number", "\\boxed{\\frac{1}{2}}"]
    assert boxed_answer([None] * 4, completions, answer=["1000", "14", "3", "\\frac{1}{2}"]) == [1.0, 1.0, 0.0, 1.0]
    assert boxed_answer([None], ["\\boxed{13} and later 14"], answer=["14"]) == [0.0]  # boxed wins
    assert format_reward([None] * 2, ["<think>a</think> so \\boxed{2}", "\\boxed{2}"]) == [1.0, 0.0]
    assert contains_number([None] * 4, ["it is 7", "seven", "-.5 then", "x2y"]) == [1.0, 0.0, 1.0, 1.0]


# ------------------------------------------------------------------ refusals
def test_refused_settings():
    config = tiny_config(seq_length=SEQ)
    with pytest.raises(ValueError, match="num_generations must be >= 2.*group of one"):
        GRPOModule(config, num_generations=1)
    with pytest.raises(ValueError, match="reward function 'lightning_mcore.rewards.no_such'.*not found"):
        GRPOModule(config, reward_funcs=["lightning_mcore.rewards.no_such"])
    with pytest.raises(ValueError, match="reward function 'no_such_pkg.fn': cannot import module 'no_such_pkg'"):
        GRPOModule(config, reward_funcs=["no_such_pkg.fn"])
    with pytest.raises(ValueError, match="max_completion_length=32 leaves no room"):
        GRPOModule(config, max_completion_length=SEQ)
    module = GRPOModule(config, max_completion_length=20)
    with pytest.raises(ValueError, match="prompts of up to 16 tokens \\+ max_completion_length=20 exceed"):
        module.check_prompt_length(16, "data")


def bad_length(prompts, completions, **_):
    return [1.0]


def raises(prompts, completions, **_):
    raise KeyError("answer")


def test_reward_that_fails_is_named():
    module = GRPOModule(tiny_config(seq_length=SEQ), num_generations=2, max_completion_length=8,
                        reward_funcs=["lightning_mcore.rewards.boxed_answer", f"{__name__}.bad_length"])
    with pytest.raises(ValueError, match="reward function test_grpo.bad_length returned 1 rewards for 2 completions"):
        module.score_rollout([[1], [1]], [[2], [3]], ["q", "q"], ["4", "5"], {"answer": ["4", "4"]})
    module = GRPOModule(tiny_config(seq_length=SEQ), num_generations=2, max_completion_length=8,
                        reward_funcs=[raises])
    with pytest.raises(ValueError, match="reward function raises raised KeyError: 'answer'"):
        module.score_rollout([[1], [1]], [[2], [3]], ["q", "q"], ["4", "5"], {})


def write_config(tmp_path, gbs=8, max_prompt_length=40, **model):
    import yaml

    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False,
                    "strategy": {"class_path": "lightning_mcore.MegatronStrategy",
                                 "init_args": {"global_batch_size": gbs, "micro_batch_size": 2}}},
        "model": {"class_path": "lightning_mcore.GRPOModule",
                  "init_args": {"model": str(ROOT / "configs/sample_data/tiny-llama"),
                                "model_overrides": {"seq_length": 64}, "num_generations": 4,
                                "max_completion_length": 16, **model}},
        "data": {"class_path": "lightning_mcore.data.PromptDataModule",
                 "init_args": {"paths": str(ROOT / "configs/sample_data/prompts.jsonl"),
                               "tokenizer": str(ROOT / "configs/sample_data/tiny-llama"),
                               "max_prompt_length": max_prompt_length, "chat_template": "chatml"}},
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gbs=6), "global_batch_size=6.*gives each of the 1 data-parallel rank\\(s\\) 6 completions, "
                  "not a multiple of num_generations=4"),
    (dict(max_prompt_length=56), "model.init_args.max_completion_length: data.init_args.max_prompt_length=56: "
                                 "prompts of up to 56 tokens \\+ max_completion_length=16 exceed"),
    (dict(num_generations=1), "model.*num_generations must be >= 2"),
    (dict(reward_funcs=["my_rewards.missing"]), "reward function 'my_rewards.missing': cannot import"),
])
def test_cli_refuses_before_launch(tmp_path, capsys, kwargs, message):
    import re

    from lightning_mcore.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", write_config(tmp_path, **kwargs)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


# ------------------------------------------------------------------ prompt data
def test_prompt_data_batches_groups_and_iterations(tmp_path):
    """Each rank gets rows / num_generations prompts, each batch num_iterations times in a row,
    with the dataset's other columns; prompts end with the generation prompt; long ones dropped."""
    from types import SimpleNamespace

    from lightning_mcore.data import PromptDataModule

    records = [json.loads(line) for line in (ROOT / "configs/sample_data/prompts.jsonl").read_text().splitlines()]
    long = {"prompt": "plus " * 200, "answer": "0"}
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [long] + records[:8]) + "\n")
    data = PromptDataModule(str(path), str(ROOT / "configs/sample_data/tiny-llama"), max_prompt_length=80,
                            chat_template="chatml", shuffle=False)
    module = SimpleNamespace(num_generations=4, num_iterations=2)
    data.trainer = SimpleNamespace(
        global_step=0, lightning_module=module,
        strategy=SimpleNamespace(data_parallel_batch_size=8, distributed_sampler_kwargs={"rank": 0, "num_replicas": 1}))
    data.setup("fit")
    assert data.stats == {"prompts": 9, "dropped": 1}
    batches = list(data.train_dataloader())
    assert len(batches) == 8  # 8 prompts, 2 per batch, each batch twice
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]
    assert batches[2]["prompt"] == [r["prompt"] for r in records[2:4]]
    assert batches[2]["answer"] == [r["answer"] for r in records[2:4]]
    text = data.tokenizer.decode(batches[2]["prompt_ids"][0])
    assert text == f"<|im_start|>user\n{records[2]['prompt']}<|im_end|>\n<|im_start|>assistant\n", text
    data.trainer.global_step = 4  # two rollouts done: the third batch of prompts comes next
    assert next(iter(data.train_dataloader()))["prompt"] == [r["prompt"] for r in records[4:6]]
    with pytest.raises(ValueError, match="column 'question' \\(the prompts\\) not found"):
        PromptDataModule(str(path), str(ROOT / "configs/sample_data/tiny-llama"), 48, prompt="question",
                         chat_template="chatml")


@pytest.mark.distributed
def test_grpo_learns_a_toy_reward(tmp_path):
    """Acceptance 4: the bundled tiny model, whose samples are mostly noise, learns to start its
    answers with one of the letters a-j (about 1 in 8 of its samples do at first)."""
    pytest.importorskip("lightning_mcore.generation.batched")
    from lightning_mcore.data import PromptDataModule

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say a number ({i})", "answer": "7"}) + "\n" for i in range(64)))
    out = tmp_path / "rewards.json"

    class Rewards(L.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.rows.append(float(trainer.callback_metrics["train/reward"]))

        def on_train_end(self, trainer, pl_module):
            out.write_text(json.dumps(self.rows))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=16, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Rewards()],
        strategy=MegatronStrategy(global_batch_size=16, micro_batch_size=8, start_method="fork"),
    )
    module = GRPOModule(str(ROOT / "configs/sample_data/tiny-llama"),
                        OptimizerSettings(lr=3e-3, warmup_steps=0, decay_style="constant"),
                        model_overrides={"seq_length": 96}, reward_funcs=[f"{__name__}.starts_early_in_the_alphabet"],
                        num_generations=8, max_completion_length=4)
    data = PromptDataModule(str(path), str(ROOT / "configs/sample_data/tiny-llama"), 64, chat_template="chatml")
    trainer.fit(module, data)
    rewards = json.loads(out.read_text())
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.8, rewards


def starts_early_in_the_alphabet(prompts, completions, **_):
    return [float(c[:1] in "abcdefghij") for c in completions]


@pytest.mark.distributed
def test_grpo_step_through_prompt_data_and_rewards(tmp_path, monkeypatch):
    """The rollout path below a stand-in for generation (generation/batched.py's API, in
    objectives/grpo.py's names): each prompt
    asked for num_generations times with its stop tokens and a per-step seed; rewards read the
    decoded completions and the dataset's `answer` column."""
    from types import SimpleNamespace

    from lightning_mcore.data import PromptDataModule
    from lightning_mcore.objectives import grpo

    calls = tmp_path / "calls.jsonl"
    tokenizer = PromptDataModule(str(ROOT / "configs/sample_data/prompts.jsonl"),
                                 str(ROOT / "configs/sample_data/tiny-llama"), 80).tokenizer

    class SamplingSettings:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    def generate_traced(strategy, chunks, prompts, cfg, sampling, routing=False):
        with open(calls, "a") as f:
            f.write(json.dumps({"prompts": prompts, "stop": sampling.stop, "seed": sampling.seed,
                                "max_new_tokens": sampling.max_new_tokens, "routing": routing}) + "\n")
        texts = ["\\boxed{3}", "\\boxed{13}", "it is 13", "14"]  # per completion of a group
        ids = [tokenizer(texts[i % G], add_special_tokens=False)["input_ids"] for i in range(len(prompts))]
        return SimpleNamespace(completions=ids, logps=[[-1.0] * len(c) for c in ids], routing=None)

    monkeypatch.setattr(grpo, "SamplingSettings", SamplingSettings)
    monkeypatch.setattr(grpo, "generate_traced", generate_traced)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {n} plus 10?", "answer": str(n + 10)}) + "\n"
                            for n in (3, 4)))
    out = tmp_path / "metrics.json"

    class Metrics(L.Callback):
        def on_train_end(self, trainer, pl_module):
            out.write_text(json.dumps({k: float(v) for k, v in trainer.callback_metrics.items()}))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Metrics()],
        strategy=MegatronStrategy(global_batch_size=8, micro_batch_size=4, start_method="fork"),
    )
    module = GRPOModule(str(ROOT / "configs/sample_data/tiny-llama"), OptimizerSettings(lr=1e-3),
                        model_overrides={"seq_length": 128}, num_generations=G, max_completion_length=16,
                        reward_funcs=["lightning_mcore.rewards.boxed_answer"],
                        sampling=GRPOSampling(seed=7, stop=[5]))
    trainer.fit(module, PromptDataModule(str(path), str(ROOT / "configs/sample_data/tiny-llama"), 80, shuffle=False))
    (call,) = [json.loads(line) for line in calls.read_text().splitlines()]
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {n} plus 10?"}],
                                                tokenize=False, add_generation_prompt=True) for n in (3, 4)]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompt_ids]
    assert call["prompts"] == [p for p in prompt_ids for _ in range(G)]
    assert call["stop"] == sorted({5, tokenizer.eos_token_id}) and call["seed"] == 7
    assert call["max_new_tokens"] == 16 and call["routing"] is False  # a dense model routes nothing
    metrics = json.loads(out.read_text())
    # prompt 3+10: "\boxed{13}" and "it is 13" right; prompt 4+10: "14" right (the last number)
    assert metrics["train/reward"] == 3 / 8
    assert metrics["train/rewards/lightning_mcore.rewards.boxed_answer"] == 3 / 8
    assert abs(metrics["train/reward_std"] - math.sqrt(3 / 8 * 5 / 8)) < 1e-6
    texts = ["\\boxed{3}", "\\boxed{13}", "it is 13", "14"]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert metrics["train/completion_length"] == sum(lengths) / G
    assert metrics["train/completion_length_max"] == max(lengths)
