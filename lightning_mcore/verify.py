"""`lightning-mcore verify`: does our model compute what transformers computes for a checkpoint?

    lightning-mcore verify --model hf-dir --tensor_model_parallel_size 2 --sequence_parallel
    lightning-mcore verify --model exported-dir --reference original-dir

Loads the HF directory into our model at the layout given (MegatronStrategy ranks, as `fit`
starts them), runs a few prompts through it and through transformers' AutoModelForCausalLM
(loaded from --reference, by default the same directory; experts run eagerly), and prints the
largest logit difference, the top-1 agreement and a JSON line. Every decoder layer's output
(captured with forward hooks on both sides) and the logits are compared, each against its own
tolerance; past one, verify names the first decoder layer that differs (`model.layers.K`,
transformers' module name).

Exit codes: 0 pass; 1 a difference past the tolerance (or a failure in our model's ranks, with
one `error:` line); 2 a mistake in the command or files (no config.json or weights, a damaged
weights file, an unsupported architecture, a reference of another shape, a layout that cannot
work), found before any rank starts, one `error:` line; 4 transformers' reference failed to load
or run, one `error:` line (not 3: that is a rank's own refusal, refusals.REFUSED_EXIT).

Differences are relative, per token: max |ours - reference| / max(1, max |reference|) over one
position's logits (or hidden state), the largest over the prompts' positions. So they mean the
same for small random models and for trained ones whose logits reach 30 and whose residual
stream carries outliers in the thousands on a few tokens (an absolute bf16 error there says
nothing, and scaling by those outliers would hide every other token).

Tolerances are measured on the reference: transformers' model runs the prompts a second time at
another precision, and that difference (its own rounding, for this model and these prompts)
times a factor, with a floor, is each output's tolerance. See `tolerance_rule`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NoReturn, Optional

import lightning as L
import torch
import torch.distributed as dist
import transformers
from jsonargparse import ActionYesNo, ArgumentParser
from lightning.fabric.utilities.exceptions import MisconfigurationException
from megatron.core import parallel_state as ps
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoTokenizer

from lightning_mcore import LayoutError, MegatronStrategy, PretrainModule
from lightning_mcore.hf.checkpoint import INDEX, SINGLE, CheckpointError, open_safetensors, weight_map
from lightning_mcore.refusals import deliberate, report_refusals
from lightning_mcore.strategy.forked_ranks import ending_forked_rank

# Tolerances: (floor, factor) per precision of the comparison; an output's tolerance is factor x
# the reference's own difference between two precisions on the same prompts, at least floor.
# fp32 (the default, on CPU): transformers' model in float32 vs float64 differs by 1.5e-8..5e-8
# per layer and 7e-8..3e-7 on the logits (tiny models of 6 families), 1e-6 for a 16-layer Llama
# 128 wide, 5e-6 for the tiny Gemma 3 (larger activations); our fp32 model differs from
# transformers' fp32 by 0..1.23x that (those models at TP=1 and TP=2 with SP, prompts of 32 and
# 250 tokens). One corrupted weight moves an output by 390x to 1e6x it: DeepSeek-V3 with two rows
# of one q_b_proj swapped by 1.3e-4 on the logits (the fixed 1e-3 used before passed it), one
# expert entry doubled by 7.8e-6. Hence 10x, at least 1e-6 (16 float32 roundings, 2^-24 each).
# bf16 (GPU, Transformer Engine): one rounding is 2^-9 = 2e-3; transformers' own model cast to
# bf16 is 0.002-0.03 off its fp32 logits (0.001-0.005 at the last layer), Gemma 3's 0.096 (0.106),
# and our bf16 runs came within 1.13x of that on GPU (benchmarks/RESULTS.md, issue 18: logits
# 0.002-0.028, Gemma 3 0.108) and 1.4x on CPU (local spec, Gemma 3's second layer: 0.097 against
# 0.070). Hence 2x, at least 0.1, which leaves room for depth (bf16 layer outputs grow ~4e-3 x
# sqrt(layer): 4e-2 at 80 layers): a broken mapping (garbled heads, a wrong rotary layout in a
# trained model) lands far above it; a single corrupted weight does not, and is the fp32 run's
# to catch. fp32 with Transformer Engine (GPU, --precision 32-true): TE runs fp32 GEMMs in
# TF32 (10-bit mantissa, a quarter of bf16's rounding), hence a floor of a quarter of bf16's.
FP32_RULE, TF32_RULE, BF16_RULE = (1e-6, 10.0), (2.5e-2, 10.0), (1e-1, 2.0)
PRECISIONS = ("32-true", "bf16-mixed")
# 3 is a rank's own refusal (refusals.REFUSED_EXIT); a reference failure is neither that nor a mismatch
MISMATCH_EXIT, USAGE_EXIT, REFERENCE_FAILED_EXIT = 1, 2, 4
REFERENCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The default prompts: with a tokenizer in the model (or reference) directory, these texts;
# without one, TOKEN_ROWS fixed rows of TOKEN_LENGTH token ids drawn from the vocab (seeded).
TEXTS = (
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1905 Albert Einstein published four papers that changed how physicists think about "
    "space, time, light and matter.",
)
TOKEN_ROWS, TOKEN_LENGTH, TOKEN_SEED = 3, 32, 0
PAD_TOKEN = 0  # after a prompt's end: causal attention keeps earlier positions unchanged
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class VerifyError(ValueError):
    """A mistake found before any rank starts: the CLI prints it as one `error:` line, exit 2."""


class ReferenceFailed(RuntimeError):
    """transformers could not load or run the reference: not a mismatch, exit 4."""


@dataclass(frozen=True)
class Rule:
    """How each output's tolerance is set: `factor` x the reference's own difference between its
    run in its dtype and a second run cast to `noise_dtype` (None: no second run), at least
    `floor`."""

    floor: float
    factor: float
    noise_dtype: Optional[torch.dtype]
    basis: str  # the rule in words, for the report

    def tolerance(self, noise: Optional[float]) -> float:
        """An unmeasured or non-finite noise leaves the floor."""
        if noise is None or not math.isfinite(noise):
            return self.floor
        return max(self.floor, self.factor * noise)


def tolerance_rule(precision: str, use_te: bool, reference_dtype: str,
                   tolerance: Optional[float] = None) -> Rule:
    """The rule for our model at `precision` against the reference in `reference_dtype` (see
    the comment on FP32_RULE): the noise comes from the precision the comparison rounds at,
    bf16 where either side runs in it. A given `tolerance` applies to every output as it is."""
    if tolerance is not None:
        return Rule(tolerance, 0.0, None, f"--tolerance={tolerance:g} for every output")
    reference = REFERENCE_DTYPES[reference_dtype]
    if precision == "bf16-mixed" or reference == torch.bfloat16:
        (floor, factor), other = BF16_RULE, torch.float32 if reference == torch.bfloat16 else torch.bfloat16
    else:
        (floor, factor), other = TF32_RULE if use_te else FP32_RULE, torch.float64
    names = [str(d).removeprefix("torch.") for d in (reference, other)]
    return Rule(floor, factor, other, f"{factor:g}x transformers' own {names[0]} vs {names[1]} "
                                      f"difference per output, at least {floor:g}")


@dataclass(frozen=True)
class Layout:
    """Where our model runs: MegatronStrategy's parallel sizes, the devices and the precision."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    devices: Optional[int] = None  # None: the fewest the sizes need
    accelerator: str = "cpu"
    precision: Optional[str] = None  # None: 32-true on CPU, bf16-mixed on GPU
    # how the ranks start: "popen" re-runs the program; "fork" from Python (tests); None (the
    # command's default, `main` only): forked from this process on CPU (fork_ranks), else popen
    start_method: Optional[str] = "popen"

    @property
    def parallel(self) -> dict:
        names = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")
        return {n: getattr(self, n) for n in names}

    @property
    def world_size(self) -> int:
        """`devices`, or the fewest ranks: one pipeline stage needs tp ranks for the dense part
        and ep x etp for the experts."""
        if self.devices is not None:
            return self.devices
        tp, ep = self.tensor_model_parallel_size, self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size or tp
        return self.pipeline_model_parallel_size * math.lcm(max(tp, 1), max(ep * etp, 1))

    @property
    def dtype_name(self) -> str:
        return self.precision or ("32-true" if self.accelerator == "cpu" else "bf16-mixed")

    def describe(self, use_te: bool) -> str:
        p = self
        parts = [f"TP={p.tensor_model_parallel_size}", f"PP={p.pipeline_model_parallel_size}"]
        if p.expert_model_parallel_size > 1 or p.expert_tensor_parallel_size:
            parts += [f"EP={p.expert_model_parallel_size}",
                      f"ETP={p.expert_tensor_parallel_size or p.tensor_model_parallel_size}"]
        parts += ["SP"] if p.sequence_parallel else []
        spec = "Transformer Engine layers" if use_te else "local layers"
        return f"{' '.join(parts)}, {self.world_size} {self.accelerator} device(s), {self.dtype_name}, {spec}"


@dataclass
class Prompts:
    """Rows of token ids right-padded to one length; only the first `lengths[i]` are compared."""

    tokens: torch.Tensor  # [rows, seq]
    lengths: list[int]
    source: str

    def mask(self) -> torch.Tensor:
        """[rows, seq] True at the prompts' own tokens."""
        return torch.arange(self.tokens.shape[1])[None, :] < torch.tensor(self.lengths)[:, None]


@dataclass
class Report:
    """What verify found; `passed` decides the exit code."""

    model: str
    reference: str
    layout: str
    prompts: str
    rule: str  # how the tolerances were set (Rule.basis)
    tolerance: float  # the logits'
    max_logit_diff: float  # absolute
    max_logit: float  # max |reference logit|, the scale
    logit_diff: float  # relative, per position (relative_diff)
    logit_noise: Optional[float]  # the reference's own difference between two precisions
    top1_agree: int
    positions: int
    layer_diffs: dict[str, float] = field(default_factory=dict)  # HF layer name -> relative diff
    layer_noise: dict[str, float] = field(default_factory=dict)
    layer_tolerances: dict[str, float] = field(default_factory=dict)
    first_divergent: Optional[str] = None
    passed: bool = False

    def table(self) -> str:
        rows = [
            ("model", self.model if self.reference == self.model
             else f"{self.model} (reference: {self.reference})"),
            ("layout", self.layout),
            ("prompts", self.prompts),
            ("max |logit diff|", f"{self.max_logit_diff:.3e} (largest |logit| {self.max_logit:.3g})"),
            ("relative diff", f"{self.logit_diff:.3e} (tolerance {self.tolerance:.3g})"),
            ("tolerances", self.rule),
            ("top-1 agreement", f"{self.top1_agree}/{self.positions} "
                                f"({100 * self.top1_agree / max(self.positions, 1):.1f}%)"),
        ]
        if not self.passed:
            diff = self.layer_diffs.get(self.first_divergent)
            limit = self.layer_tolerances.get(self.first_divergent)
            rows.append(("first divergence", f"{self.first_divergent}" + (
                f" (relative diff {diff:.3e}, tolerance {limit:.3g})" if diff is not None else "")))
        rows.append(("result", "PASS" if self.passed else "FAIL"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------- comparison
def relative_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest over positions of max |ours - ref| / max(1, max |ref|) along the last
    dimension (one position's logits or hidden state); inf where a side is not finite."""
    ours, ref = ours.double(), ref.double()
    if not (torch.isfinite(ours).all() and torch.isfinite(ref).all()):
        return math.inf
    if ref.numel() == 0:
        return 0.0
    scale = ref.abs().amax(-1).clamp(min=1.0)
    return float(((ours - ref).abs().amax(-1) / scale).max())


def first_divergent(diffs: dict[str, float], tolerances: dict[str, float]) -> Optional[str]:
    """The first output (in order) past its tolerance, or None."""
    for name, diff in diffs.items():
        if not diff <= tolerances[name]:
            return name
    return None


def compare(ours: dict, ref: dict, noisy: Optional[dict], prompts: Prompts, rule: Rule,
            names: list[str]) -> dict:
    """Report fields from both sides' logits [rows, seq, vocab] and layer outputs
    {index: [rows, seq, hidden]}, and the reference's second run (`noisy`, None: not run) that
    sets the tolerances; only the prompts' own positions count."""
    mask = prompts.mask()
    a, b = ours["logits"][mask], ref["logits"][mask]
    finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
    max_diff = float((a.double() - b.double()).abs().max()) if finite else math.inf
    kept = [i for i in range(len(names)) if i in ours["layers"] and i in ref["layers"]]
    diffs = {names[i]: relative_diff(ours["layers"][i][mask], ref["layers"][i][mask]) for i in kept}
    noise = {names[i]: relative_diff(noisy["layers"][i][mask], ref["layers"][i][mask])
             for i in kept if i in noisy["layers"]} if noisy is not None else {}
    logits = f"after {names[-1]} (the final norm or the output layer)"
    diffs[logits] = relative_diff(a, b)
    noise[logits] = relative_diff(noisy["logits"][mask], b) if noisy is not None else None
    tolerances = {name: rule.tolerance(noise.get(name)) for name in diffs}
    first = first_divergent(diffs, tolerances)
    logit_diff, logit_noise, tolerance = diffs.pop(logits), noise.pop(logits), tolerances.pop(logits)
    return dict(
        rule=rule.basis, tolerance=tolerance, max_logit_diff=max_diff, max_logit=float(b.abs().max()),
        logit_diff=logit_diff, logit_noise=logit_noise,
        top1_agree=int((a.argmax(-1) == b.argmax(-1)).sum()), positions=int(mask.sum()),
        layer_diffs=diffs, layer_noise=noise, layer_tolerances=tolerances,
        first_divergent=first, passed=first is None,
    )


# ---------------------------------------------------------------------- our side
class CaptureLayers(L.Callback):
    """Rank 0 saves the predicted logits and every decoder layer's output to `out` (ours.pt).

    Hooks keep each mcore TransformerLayer's output per microbatch ([seq, 1, hidden], its
    global `layer_number`). After the batch, sequence-parallel pieces are gathered over the
    tensor-parallel group, and one rank per pipeline stage sends its layers to rank 0."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self._kept: dict[int, list] = {}
        self._handles: list = []

    def on_predict_start(self, trainer, pl_module) -> None:
        for chunk in pl_module.chunks:
            for name, layer in chunk.named_modules():
                if re.search(r"(^|\.)decoder\.layers\.\d+$", name):
                    self._handles.append(layer.register_forward_hook(self._hook(layer.layer_number - 1)))

    def _hook(self, index: int):
        def keep(module, args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            self._kept.setdefault(index, []).append(hidden.detach().float())
        return keep

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        layers = {i: torch.cat(parts, dim=1) for i, parts in sorted(self._kept.items())}
        self._kept = {}
        if trainer.strategy.parallel.sequence_parallel:
            layers = {i: _gather_sequence(t, ps.get_tensor_model_parallel_group()) for i, t in layers.items()}
        sender = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        mine = {i: t.transpose(0, 1).cpu() for i, t in layers.items()} if sender else {}
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() == 0:
            merged = {i: t for part in gathered for i, t in part.items()}
            torch.save({"logits": outputs.float().cpu(), "layers": merged}, self.out / "ours.pt")

    def on_predict_end(self, trainer, pl_module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """The whole [seq, ...] from each tensor-parallel rank's consecutive slice of it."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def run_ours(module, trainer: L.Trainer, prompts: Prompts, out: Path) -> Optional[dict]:
    """Our logits and layer outputs (rank 0 of the run; None on the other ranks)."""
    rows = [{"tokens": row} for row in prompts.tokens]
    loader = DataLoader(rows, batch_size=len(rows))
    report_refusals(trainer, trainer.predict, model=module, dataloaders=loader, return_predictions=False)
    if trainer.global_rank != 0:  # a rank the launcher started (re-running the command, or forked)
        return None
    return torch.load(out / "ours.pt", weights_only=True)


# ---------------------------------------------------------------------- transformers' side
def run_reference(directory: str, prompts: Prompts, dtype: torch.dtype,
                  noise_dtype: Optional[torch.dtype] = None) -> tuple[dict, Optional[dict], list[str]]:
    """transformers' logits and decoder-layer outputs (on CPU) in `dtype`; with `noise_dtype`,
    again with the model cast to it in place (the tolerances' measure); the layers' module names.
    transformers failing raises ReferenceFailed."""
    with reference_failures(directory, "to load"):
        model = load_reference(directory, dtype)
    names, layers = decoder_layers(model)
    with reference_failures(directory, f"in {str(dtype).removeprefix('torch.')}"):
        ref = _forward(model, layers, prompts)
    if noise_dtype is None:
        return ref, None, names
    other = str(noise_dtype).removeprefix("torch.")
    with reference_failures(directory, f"in {other} (the second run, which measures its own rounding "
                                       f"for the tolerances; a --tolerance skips it)"):
        noisy = _forward(model.to(noise_dtype), layers, prompts)
    return ref, noisy, names


def load_reference(directory: str, dtype: torch.dtype):
    """AutoModelForCausalLM of `directory`, experts run eagerly where transformers can switch:
    its default on CPU, torch's grouped_mm, refuses odd widths ("strides should be multiple of
    16 bytes", a Mixtral with 97-wide experts) and float64."""
    # dtype: transformers defaults to the checkpoint's dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=dtype, experts_implementation="eager")
    return model.eval()


def _forward(model, layers: list, prompts: Prompts) -> dict:
    kept: dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_hook(_keep_output(kept, i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            logits = model(input_ids=prompts.tokens).logits
    finally:
        for handle in handles:
            handle.remove()
    return {"logits": _widened(logits), "layers": kept}


def _keep_output(kept: dict, index: int):
    def keep(module, args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        kept[index] = _widened(hidden.detach())
    return keep


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    """float32, or float64 kept as it is (a float64 run measures float32's rounding)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


@contextmanager
def reference_failures(directory: str, what: str):
    """transformers raising inside the block as one ReferenceFailed naming the directory, the
    error and where it was raised."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - anything transformers or torch raise

        message = (str(error).strip().splitlines() or [""])[0][:300]
        raise ReferenceFailed(
            f"--reference={directory}: transformers {transformers.__version__} failed {what}: "
            f"{type(error).__name__}: {message} (at {_where(error)}). Our model ran; nothing was "
            f"compared: this is not a mismatch."
        ) from error


def _where(error: BaseException) -> str:
    """file:line of the innermost frame, from the package directory on."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    path = frames[-1].filename
    return f"{path.split('site-packages/')[-1]}:{frames[-1].lineno}"


def decoder_layers(model) -> tuple[list[str], list]:
    """The decoder layers of a transformers causal LM and their module names (model.layers.N)."""
    count = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList) \
                and len(module) == count:
            return [f"{name}.{i}" for i in range(count)], list(module)
    raise VerifyError(f"{type(model).__name__} has no list of {count} decoder layers named `layers`.")


# ---------------------------------------------------------------------- set-up
def build_prompts(texts: Optional[list[str]], tokenizer_dirs: list[str], vocab: int, seq_length: int,
                  multiple: int) -> Prompts:
    """The prompts as token rows, padded to one length that is a multiple of `multiple`."""
    has_tokenizer = [d for d in tokenizer_dirs if any((Path(d) / f).is_file() for f in TOKENIZER_FILES)]
    tokenizer_dir = has_tokenizer[0] if has_tokenizer else None
    if texts is not None and tokenizer_dir is None:
        where = " nor ".join(dict.fromkeys(tokenizer_dirs))
        raise VerifyError(f"--prompts are text and need a tokenizer, but there is none in {where} "
                          f"({', '.join(TOKENIZER_FILES)}).")
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        given = texts is not None
        rows = [tokenizer(text)["input_ids"] for text in (texts if given else TEXTS)]
        if not given:  # the default texts fit any model: cut to its seq_length
            rows = [row[: seq_length // multiple * multiple] for row in rows]
        source = f"{len(rows)} texts, tokenized by {tokenizer_dir}"
        what = "--prompts: " if given else "the default prompts: "
        for text, row in zip(texts if given else TEXTS, rows):
            if not row:
                raise VerifyError(f"{what}{text!r} has no tokens.")
            if len(row) > seq_length:
                raise VerifyError(f"{what}{text[:40]!r}... has {len(row)} tokens, more than the "
                                  f"model's seq_length={seq_length}; shorten it.")
            if max(row) >= vocab:
                raise VerifyError(f"{what}the tokenizer in {tokenizer_dir} gives token id {max(row)}, "
                                  f"beyond the model's vocab_size={vocab}.")
    else:
        length = min(TOKEN_LENGTH, seq_length)
        generator = torch.Generator().manual_seed(TOKEN_SEED)
        rows = torch.randint(0, vocab, (TOKEN_ROWS, length), generator=generator).tolist()
        source = f"{TOKEN_ROWS} rows of {length} fixed token ids (no tokenizer in the directory)"
    lengths = [len(row) for row in rows]
    width = -(-max(lengths) // multiple) * multiple
    if width > seq_length:
        raise VerifyError(f"--prompts: the longest has {max(lengths)} tokens; padded to a multiple of "
                          f"{multiple} (sequence parallelism) it is longer than seq_length={seq_length}.")
    tokens = torch.full((len(rows), width), PAD_TOKEN, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return Prompts(tokens, lengths, f"{source}; {sum(lengths)} positions")


def check_directory(option: str, path: str) -> None:
    if not Path(path).is_dir():
        raise VerifyError(f"{option}={path} is not a directory; expected a Hugging Face checkpoint "
                          f"directory.")
    if not (Path(path) / "config.json").is_file():
        raise VerifyError(f"{option}={path} has no config.json; expected a Hugging Face checkpoint "
                          f"directory (as written by save_pretrained).")


# Weights files transformers reads besides safetensors (with weights_only, never a plain unpickle)
TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def check_weights(option: str, directory: str, torch_files: bool = False) -> None:
    """Every safetensors file of `directory` is there with a complete header (a truncated
    download), found before any rank starts; `torch_files`: transformers' .bin files will do."""
    path = Path(directory)
    safetensors = (path / SINGLE).is_file() or (path / INDEX).is_file()
    if torch_files and not safetensors and any((path / f).is_file() for f in TORCH_WEIGHTS):
        return
    if torch_files and not safetensors:
        raise VerifyError(f"{option}={directory} has no weights ({SINGLE}, {INDEX} or "
                          f"{' or '.join(TORCH_WEIGHTS)}): transformers cannot load it.")
    try:
        for file in sorted(set(weight_map(path).values())):
            with open_safetensors(file):
                pass
    except CheckpointError as error:
        raise VerifyError(f"{option}={directory}: {error}") from error


def load_module(model: str):
    """PretrainModule of the HF directory, its weights files checked; its refusals
    (unsupported architecture or field) as a VerifyError."""
    check_directory("--model", model)
    try:
        module = PretrainModule(model)
    except (ValueError, TypeError, OSError) as error:
        if not deliberate(error):
            raise
        raise VerifyError(f"--model={model}: {error}") from error
    if module.init_checkpoint is None:  # an HF directory, read by the ranks
        check_weights("--model", model)
    return module


def check_reference(reference: str, model_config) -> None:
    """A directory transformers can load whose outputs can be set beside the model's: the same
    vocabulary, width and depth; its weights files checked."""
    check_directory("--reference", reference)
    try:
        config = AutoConfig.from_pretrained(reference, local_files_only=True).get_text_config()
    except (ValueError, OSError, KeyError) as error:
        raise VerifyError(f"--reference={reference}: transformers cannot read its config.json: "
                          f"{error}") from error
    for theirs, ours, what in (("vocab_size", "vocab_size", "their logits"),
                               ("hidden_size", "hidden_size", "their hidden states"),
                               ("num_hidden_layers", "num_layers", "their layers")):
        value, expected = getattr(config, theirs, None), getattr(model_config, ours)
        if value is not None and value != expected:
            raise VerifyError(f"--reference={reference} has {theirs}={value}, the model {expected}: "
                              f"{what} cannot be compared.")
    check_weights("--reference", reference, torch_files=True)


def build_trainer(layout: Layout, module, capture: CaptureLayers) -> L.Trainer:
    """The Trainer our model runs in, its layout checked against the world size and the model."""
    world = layout.world_size
    dp = max(world // (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size), 1)
    try:
        strategy = MegatronStrategy(global_batch_size=dp, micro_batch_size=1,
                                    start_method=layout.start_method, **layout.parallel)
        trainer = L.Trainer(
            accelerator=layout.accelerator, devices=world, strategy=strategy,
            precision=layout.dtype_name, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
            callbacks=[capture],
        )
        strategy.fork_ranks()  # a no-op unless start_method was left None (the command's default)
        strategy.validate_module(module)
    except LayoutError as error:
        keys = _layout_keys(error, layout, module)
        raise VerifyError(f"invalid parallel layout ({keys}): {error}") from error
    except MisconfigurationException as error:
        raise VerifyError(f"--accelerator={layout.accelerator} --devices={world}: {error}") from error
    return trainer


def _layout_keys(error, layout: Layout, module) -> str:
    """The options (and model fields) behind a LayoutError, with their values."""
    keys = [f"--{o}={getattr(layout, o)}" for o in error.options if hasattr(layout, o)]
    keys += [f"--devices={layout.world_size}"] if error.devices else []
    keys += [f"--accelerator={layout.accelerator}"] if error.accelerator else []
    fields = ", ".join(f"{f}={getattr(module.model_config, f, None)}" for f in error.fields)
    keys += [f"--model={module.hf_path} ({fields})"] if fields else []
    return ", ".join(keys)


# ---------------------------------------------------------------------- the check
def verify(model: str, reference: Optional[str] = None, layout: Layout = Layout(),
           tolerance: Optional[float] = None, prompts: Optional[list[str]] = None,
           reference_dtype: str = "float32") -> Optional[Report]:
    """Compare our model of the HF directory `model`, run at `layout`, with transformers' model
    of `reference` (default: the same directory). Returns the Report in the launching process
    (None in the other ranks its launch starts); raises VerifyError
    on a mistake found before any rank starts, ReferenceFailed where transformers fails."""
    reference = reference or model
    if layout.dtype_name not in PRECISIONS:
        raise VerifyError(f"--precision={layout.precision}: use one of {', '.join(PRECISIONS)}.")
    if reference_dtype not in REFERENCE_DTYPES:
        raise VerifyError(f"--reference_dtype={reference_dtype}: use one of {', '.join(REFERENCE_DTYPES)}.")
    if tolerance is not None and not tolerance > 0:
        raise VerifyError(f"--tolerance={tolerance:g}: no difference is at most that; give a positive "
                          f"number, or leave it out for tolerances measured on the reference.")
    module = load_module(model)
    cfg = module.model_config
    use_te = cfg.uses_te(layout.accelerator)
    rule = tolerance_rule(layout.dtype_name, use_te, reference_dtype, tolerance)
    check_reference(reference, cfg)
    multiple = layout.tensor_model_parallel_size if layout.sequence_parallel else 1
    rows = build_prompts(prompts, [model, reference], cfg.vocab_size, cfg.seq_length, multiple)
    launching, out = os.getpid(), Path(tempfile.mkdtemp(prefix="lightning-mcore-verify-"))
    try:
        trainer = build_trainer(layout, module, CaptureLayers(out))
        ours = run_ours(module, trainer, rows, out)
    finally:
        if os.getpid() == launching:  # not a rank forked from this process (fork_ranks)
            shutil.rmtree(out, ignore_errors=True)
    if ours is None:
        return None
    del module, trainer
    ref, noisy, names = run_reference(reference, rows, REFERENCE_DTYPES[reference_dtype], rule.noise_dtype)
    found = compare(ours, ref, noisy, rows, rule, names)
    return Report(model=model, reference=reference, layout=layout.describe(use_te), prompts=rows.source,
                  **found)


EXIT_CODES = (f"Exit codes: 0 pass; {MISMATCH_EXIT} a difference past the tolerance (or a failure in our "
              f"model's ranks); {USAGE_EXIT} a mistake in the command or files, found before any rank "
              f"starts; {REFERENCE_FAILED_EXIT} transformers' reference failed to load or run.")


def main(args=None) -> None:
    parser = ArgumentParser(prog="lightning-mcore verify", description=__doc__.split("\n")[0],
                            epilog=EXIT_CODES)
    parser.add_argument("--model", type=str, required=True,
                        help="the Hugging Face directory to load into our model")
    parser.add_argument("--reference", type=Optional[str], default=None,
                        help="the Hugging Face directory transformers loads (default: --model), e.g. "
                             "the original of a converted or exported checkpoint")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--expert_tensor_parallel_size", type=Optional[int], default=None)
    parser.add_argument("--sequence_parallel", action=ActionYesNo, default=False)
    parser.add_argument("--devices", type=Optional[int], default=None,
                        help="ranks to start (default: the fewest the parallel sizes need)")
    parser.add_argument("--accelerator", type=Literal["cpu", "gpu"], default="cpu")
    parser.add_argument("--precision", type=Optional[Literal["32-true", "bf16-mixed"]], default=None,
                        help=f"our model's precision, one of {', '.join(PRECISIONS)} (default: 32-true on "
                             f"cpu, bf16-mixed on gpu)")
    parser.add_argument("--tolerance", type=Optional[float], default=None,
                        help="largest relative difference that passes, for the logits and every layer's "
                             "output: max|ours - ref| / max(1, max|ref|) over one position, the largest "
                             "over positions. Default: measured on the reference, which runs a second "
                             "time: at 32-true %gx its float32 vs float64 difference, at least %g (%g "
                             "with Transformer Engine, whose fp32 GEMMs use TF32); at bf16-mixed or "
                             "with a bfloat16 reference %gx its bfloat16 vs float32 difference, at "
                             "least %g. A given tolerance skips the second run (float64 doubles the "
                             "reference's memory)" % (FP32_RULE[1], FP32_RULE[0], TF32_RULE[0],
                                                       BF16_RULE[1], BF16_RULE[0]))
    parser.add_argument("--prompts", type=str, default=None, nargs="+",
                        help="text prompts (need a tokenizer in --model or --reference); default: a few "
                             "fixed texts, or fixed token ids where there is no tokenizer")
    parser.add_argument("--reference_dtype", type=Literal["float32", "bfloat16"], default="float32",
                        help="dtype of transformers' model, which runs on CPU")
    parser.add_argument("--start_method", type=Optional[Literal["popen", "fork", "spawn"]], default=None,
                        help="how the ranks start: by default this process is rank 0 and, on CPU, "
                             "forks the others once its imports are done (on GPU it re-runs this "
                             "command for them, as popen does); fork suits a call from Python")

    with ending_forked_rank():  # a rank forked by the launch ends here
        _verify_command(parser.parse_args(args))


def _verify_command(config) -> None:
    layout = Layout(**{k: config[k] for k in Layout.__dataclass_fields__})
    try:
        report = verify(config.model, config.reference, layout, config.tolerance, config.prompts,
                        config.reference_dtype)
    except VerifyError as error:
        _error(str(error), USAGE_EXIT)
    except ReferenceFailed as error:
        _error(str(error), REFERENCE_FAILED_EXIT)
    if report is None:
        return
    print(f"lightning-mcore verify\n{report.table()}")
    print(_json_line(report))
    sys.stdout.flush()
    if not report.passed:
        raise SystemExit(MISMATCH_EXIT)


def _json_line(report: Report) -> str:
    def finite(x):
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        return x if not isinstance(x, float) or math.isfinite(x) else None

    fields = {k: finite(v) for k, v in asdict(report).items()}
    return json.dumps({"verify": "pass" if report.passed else "fail", **fields})


def _error(message: str, code: int) -> NoReturn:
    print(f"lightning-mcore verify: error: {message}", file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
