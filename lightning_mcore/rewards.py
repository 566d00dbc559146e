"""Reward functions for GRPOModule, and the checks that name a reward that misbehaves.

A reward function is ``fn(prompts, completions, **columns) -> list[float]``: one score per
completion; ``prompts[i]`` is the dataset's prompt of completion ``i`` (repeated for each of its
group), ``completions[i]`` its decoded text, and every other dataset column comes as a keyword
list aligned the same way (e.g. ``answer``). Functions should accept ``**kwargs`` for columns
they do not read. In YAML they are given by import path, e.g. ``lightning_mcore.rewards.boxed_answer``.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Callable, Optional, Sequence, Union

RewardFn = Callable[..., list]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer(text: str) -> Optional[str]:
    """The last ``\\boxed{...}`` of `text` (nested braces allowed), else its last number."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _canonical(answer: Any) -> str:
    """Compare answers as text, numbers as numbers ("1,000" == "1000.0")."""
    text = str(answer).strip().strip("$").strip()
    try:
        value = float(text.replace(",", ""))
        return repr(value) if math.isfinite(value) else text
    except ValueError:
        return text


def boxed_answer(prompts: Sequence, completions: Sequence[str], answer: Sequence, **_: Any) -> list[float]:
    """1.0 where the completion's final answer (``\\boxed{}`` or the last number) equals the
    dataset's ``answer`` column, else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        got = final_answer(completion)
        out.append(float(got is not None and _canonical(got) == _canonical(expected)))
    return out


def contains_number(prompts: Sequence, completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 where the completion holds a number at all (what "Answer with a number." asks), else
    0.0: a format reward, learnable by a model that cannot do the arithmetic yet (the bundled
    tiny base: configs/grpo.yaml)."""
    return [float(_NUMBER.search(c) is not None) for c in completions]


# A reasoning block, then the answer: "<think>...</think> ... \boxed{...}" (DeepSeek-R1 style).
THINK_THEN_BOXED = r"(?s)^\s*<think>.+?</think>.*\\boxed\{.+\}.*$"


def format_reward(prompts: Sequence, completions: Sequence[str], pattern: str = THINK_THEN_BOXED,
                  **_: Any) -> list[float]:
    """1.0 where the whole completion matches the regular expression `pattern` (default: a
    ``<think>...</think>`` block followed by a ``\\boxed{}`` answer), else 0.0. Another format:
    ``functools.partial(format_reward, pattern=...)`` or a function of your own."""
    regex = re.compile(pattern)
    return [float(regex.fullmatch(c) is not None) for c in completions]


def resolve_reward(spec: Union[str, RewardFn]) -> RewardFn:
    """The callable behind an import path ``"package.module.function"`` (or a callable)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or "." not in spec:
        raise ValueError(f"reward function {spec!r}: give an import path such as "
                         "'lightning_mcore.rewards.boxed_answer' or a callable")
    module_name, _, attr = spec.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} "
                         f"({error}); check the path and that the module is installed") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = "not found" if fn is None else f"a {type(fn).__name__}, not a function"
        raise ValueError(f"reward function {spec!r}: {attr!r} in {module_name} is {found}")
    return fn


def reward_name(fn: RewardFn) -> str:
    """A short name for logs and errors: the function's, or its class's."""
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def score(fn: RewardFn, name: str, prompts: list, completions: list[str], columns: dict) -> list[float]:
    """`fn`'s rewards, refused with a message naming `name` when it raises or returns anything
    but one finite number per completion."""
    try:
        values = fn(prompts, completions, **columns)
    except Exception as error:  # noqa: BLE001 - any failure of user code, named
        raise ValueError(f"reward function {name} raised {type(error).__name__}: {error}") from error
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"reward function {name} must return a list of numbers, got "
                         f"{type(values).__name__}") from None
    if len(values) != len(completions):
        raise ValueError(f"reward function {name} returned {len(values)} rewards for "
                         f"{len(completions)} completions (one per completion expected)")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"reward function {name} returned a non-finite reward: {values}")
    return values
