"""LoRA over a quantized frozen base (LoRAConfig.base_precision "fp8", "nf4" or "mxfp4"): the base
weights that LoRA adapts are held as codes and scales, and turned back into the model's dtype for
each call only. A `Codec` says how: "fp8" (below), "nf4" (4-bit NormalFloat codes, an absmax
scale per block of 64 along the input dimension: lora/nf4.py) or "mxfp4" (E2M1 codes, a
power-of-two scale per block of 32: lora/mxfp4.py). Everything else (the hooks, placeholders,
merging, the error report) is one mechanism for all.

FP8:

    codes  [out, in]  float8_e4m3fn   = round(W / s)         (saturating at +-448)
    scales [out]      fp32            s = amax(|W row|) / 448 over the FULL row of the HF tensor

A row of an mcore weight is a row of an HF weight (fused QKV and SwiGLU fc1 interleave whole
rows), so column-parallel shards already hold full rows; a row-parallel shard holds a slice of
each row and takes the row's max over its (expert-)TP group. Codes and scales are therefore the
same numbers at any TP / EP / PP layout, and a resume, which loads the bf16 base again from the
HF checkpoint, quantizes it again to the same codes (rounding is deterministic).

How a base linear computes with them (dequantize on the fly, exact gradients for the
dequantized weight W' = codes * s):

    forward pre-hook   the weight parameter's data := W' (a fresh tensor, this call only);
                       the owner's saved-tensor hooks are pushed
    mcore's forward    unchanged (its TP communication, sequence parallel, the LoRA hook):
                       y = x W'^T; autograd saves (x, W'): the pack hook stores W' as a
                       reference to the codes, not as a tensor
    forward hook       hooks popped; the parameter's data := a zero-stride placeholder
                       (one element, the weight's shape), so W' is freed
    backward           the unpack hook dequantizes again: grad x = g W' (the base is frozen:
                       no weight gradient)

So between forward and backward only codes (fp8: 1 byte/element, nf4: 1/2) stay alive, not a
bf16 copy of every layer's weights. The pack hook hands every other tensor to the saved-tensor
hooks that were active around the call (activation offloading, a measurement), so it composes
with them.
Torch's grouped experts (model/torch_experts.py) hold one block [E, out, in] of codes per linear
and skip the parameters altogether: their grouped GEMM takes the dequantized block from the record
(lora/grouped_base.py), with no per-expert views or placeholders per call.

The parameters stay the model's (frozen, requires_grad=False): names, checkpoint keys and HF
mappings unchanged; mcore's DDP and optimizer take only trainable ones (the adapters). Codes and
scales are non-persistent buffers of the owning module (they move with it, are never saved:
the base comes from the HF checkpoint). Merging (set_merged: merged export, generation) gives
the parameter real data W' + scale B A; unmerging puts the placeholder back.

An owner that computes from the record itself is `direct` (the hooks then leave its parameters
alone): torch's grouped experts always, and with LoRAConfig.base_gemm "fp8" every adapted linear,
whose forward multiplies the codes by FP8 GEMMs (lora/fp8_gemm.py); their backward dequantizes,
for the exact input gradient.

Transformer Engine (GPU, not done yet: LoRA's plan check refuses fp8 and nf4 with TE layers) can
plug into the same record: its Linear / LayerNormLinear read `self.weight` (TEGroupedLinear:
`weight<e>`) in forward, so the same pre-hook / placeholder / saved-tensor hooks work for a
dequantize-on-the-fly path (TE saves the weight it computes with when it is not casting it). A
real FP8 GEMM instead hands TE the codes and scales as a Float8Tensor (per-row scales need TE's
blockwise/"Float8BlockScaling" recipe on Hopper, 1x128 blocks: quantize with that block shape
there), and the input gradient then comes from TE's own FP8 backward GEMM. NF4 has no GEMM of
its own: it dequantizes (as bitsandbytes does), so only the dequantize-on-the-fly path applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_mcore.lora import mxfp4, nf4

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def row_scales(t: torch.Tensor, group=None) -> torch.Tensor:
    """[..., 1] fp32: amax / 448 over each whole row of `t` (its max taken over `group` when the rows
    are split across it: row-parallel); 1 for an all-zero row, whose codes are then 0."""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def to_e4m3(t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The e4m3 codes of t / scales (in fp32, saturating at +-448)."""
    return (t.detach().float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `weight` [..., out, in]: one scale per row (row_scales)."""
    scales = row_scales(weight, group)
    return to_e4m3(weight, scales), scales.squeeze(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes * scale per row, computed in fp32, in `dtype`."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


# rows dequantized at a time: their fp32 intermediates (~10-15 bytes an element) stay near 2^24
# elements' worth, not a whole [E, out, in] experts block's (~9 GB for a Qwen3-30B-A3B layer in nf4)
CHUNK_ELEMENTS = 1 << 24


def dequantized(codec: "Codec", codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codec.dequantize of codes [..., out, c] and their scales into one tensor of `dtype`: on
    CUDA as one fused kernel (`fused`), elsewhere a few rows at a time (the same values either
    way: each element is computed alone)."""
    if codes.is_cuda:
        with torch.no_grad():  # never needs one (codes are buffers); one compiled variant, not one per grad mode
            return fused(codec)(codes, scales, dtype)
    lead, rows = codes.shape[:-1], codes.shape[:-1].numel()
    flat_codes = codes.reshape(rows, codes.shape[-1])
    flat_scales = scales.reshape(rows, *scales.shape[codes.dim() - 1:])
    width = codec.dequantize(flat_codes[:1], flat_scales[:1], dtype).shape[-1]
    out = torch.empty(rows, width, dtype=dtype, device=codes.device)
    step = max(1, CHUNK_ELEMENTS // width)
    for start in range(0, rows, step):
        rows_here = slice(start, start + step)
        out[rows_here] = codec.dequantize(flat_codes[rows_here], flat_scales[rows_here], dtype)
    return out.reshape(*lead, width)


_FUSED: dict = {}


def fused(codec: "Codec") -> Callable:
    """codec.dequantize compiled by torch.compile: one kernel that reads the codes and writes the
    weight. Eager, it runs 3-5 kernels through fp32 intermediates, which on one H200 made
    dequantization ~2/3 of a Qwen3-30B-A3B LoRA step over an FP8 base (a layer's experts: 3.9 ms
    eager, 0.41 ms fused, equal bit for bit: benchmarks/dequant_speed.py, RESULTS.md session 27)."""
    if codec.name not in _FUSED:
        _FUSED[codec.name] = torch.compile(codec.dequantize, dynamic=False)
    return _FUSED[codec.name]


@dataclass(frozen=True)
class Codec:
    """How one base precision holds a weight [..., out, in] as (codes, scales) and gives it back."""

    name: str  # the LoRAConfig.base_precision, and the suffix of the codes' buffer
    quantize: Callable  # (weight, row-parallel group or None) -> (codes, scales)
    dequantize: Callable  # (codes, scales, dtype) -> weight
    code_bytes: float = 1.0  # bytes a code takes (nf4, mxfp4: two codes a byte)
    block: Optional[int] = None  # elements a scale covers along a row (None: the whole row)
    description: str = ""
    scale_bytes: int = 4  # bytes a scale takes (fp32; mxfp4's E8M0 exponent: 1)


CODECS = {codec.name: codec for codec in (
    Codec("fp8", quantize_rows, dequantize, description="e4m3, a scale per output row"),
    Codec("nf4", nf4.quantize_blocks, nf4.dequantize_blocks, 0.5, nf4.BLOCK,
          description=f"4-bit NormalFloat, an absmax scale per {nf4.BLOCK} inputs"),
    Codec("mxfp4", mxfp4.quantize_blocks, mxfp4.dequantize_blocks, 0.5, mxfp4.BLOCK,
          description=f"E2M1, a power-of-two scale per {mxfp4.BLOCK} inputs", scale_bytes=1))}


@dataclass
class QuantizedWeights:
    """The codes of frozen weights that one module computes with: a linear's `weight`, or the
    rows of torch's grouped experts' [E, out, in] block (`params[e]`: expert e's weight).
    Codes and scales are the owner's buffers `<name>_<codec>` (`_fp8`, `_nf4`, `_mxfp4`) and
    `<name>_scale`."""

    owner: torch.nn.Module
    name: str
    params: list
    dtype: torch.dtype
    shape: tuple  # of the codes: [out, in] or [E, out, in] (nf4, mxfp4: in / 2)
    codec: Codec = CODECS["fp8"]
    merged: bool = False  # the params hold real data (set_merged), the hooks leave them be
    direct: bool = False  # the owner computes from the record (grouped_base.py, fp8_gemm.py): no values per call
    live: list = field(default_factory=list)  # the materialisations of calls in progress

    @property
    def codes(self) -> torch.Tensor:
        return getattr(self.owner, f"{self.name}_{self.codec.name}")

    @property
    def scales(self) -> torch.Tensor:
        return getattr(self.owner, f"{self.name}_scale")

    def values(self, index: Optional[int] = None) -> torch.Tensor:
        """The dequantized weight (of expert `index` for a block), a new tensor."""
        if index is None:
            return dequantized(self.codec, self.codes, self.scales, self.dtype)
        return dequantized(self.codec, self.codes[index], self.scales[index], self.dtype)

    def index_of(self, param) -> Optional[int]:
        return None if len(self.shape) == 2 else next(i for i, p in enumerate(self.params) if p is param)

    def materialize(self) -> torch.Tensor:
        """Give the params the dequantized values for one call; returns the tensor they view."""
        full = self.values()
        for i, p in enumerate(self.params):
            p.data = full if len(self.shape) == 2 else full[i]
        return full

    def release(self) -> None:
        """Back to the placeholder: the params hold one element each, the codes everything."""
        for p in self.params:
            p.data = placeholder(p.shape, self.dtype, self.codes.device)


def placeholder(shape, dtype, device) -> torch.Tensor:
    """A weight-shaped tensor of one element (zero strides): shape-reading code works, writing
    into it fails, and it holds no memory."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


class _Packed:
    """A saved weight as autograd keeps it: its quantized record and its view of the call's
    dequantized tensor; unpacked by dequantizing once per backward node (experts: E views)."""

    def __init__(self, record: QuantizedWeights, view: tuple, cache: dict) -> None:
        self.record, self.view, self.cache = record, view, cache  # cache: shared by one call's views


class _CallHooks:
    """The saved-tensor hooks of one call of a quantized module: a saved tensor in the storage
    of the call's dequantized weight is packed as a reference to the codes; any other goes to
    the hooks that were active outside (or is kept as it is)."""

    def __init__(self, record: QuantizedWeights, full: torch.Tensor) -> None:
        self.record, self.storage = record, full.untyped_storage().data_ptr()
        self.cache: dict = {}
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # torch's own stack
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if t.numel() and t.untyped_storage().data_ptr() == self.storage:
            return _Packed(self.record, (tuple(t.size()), tuple(t.stride()), t.storage_offset()), self.cache)
        return self.outer[0](t) if self.outer else t

    def unpack(self, packed):
        if isinstance(packed, _Packed):
            if "full" not in packed.cache:
                packed.cache["full"] = packed.record.values()
            return packed.cache["full"].as_strided(*packed.view)
        return self.outer[1](packed) if self.outer else packed


def _pre_hook(record: QuantizedWeights):
    """Materialise and push the call's hooks; the forward hook pops them (a forward that raises
    leaves them pushed: the step fails anyway)."""

    def hook(module, args):
        if record.merged or record.direct:
            return
        call = _CallHooks(record, record.materialize())
        call.context.__enter__()
        record.live.append(call)

    return hook


def _post_hook(record: QuantizedWeights):
    def hook(module, args, output):
        if record.live:
            call = record.live.pop()
            call.context.__exit__(None, None, None)
            # the context holds the call's bound pack/unpack: dropped, the call is no longer a
            # reference cycle, and its dequantized weight (cached by backward's unpack) goes
            # with the saved tensors, not at the garbage collector's next full pass (which
            # training defers: a Llama-3-8B over an FP8 base grew ~25 GiB a step on GPU)
            call.context = None
            if not record.live:
                record.release()

    return hook


@torch.no_grad()
def quantize_module(owner: torch.nn.Module, name: str, params: list, weight: torch.Tensor,
                    group=None, codec: Codec = CODECS["fp8"]) -> QuantizedWeights:
    """Quantize `weight` ([out, in], or the [E, out, in] block `params` view) with `codec` into
    buffers of `owner`, free the params' data and hook `owner`'s calls (module docstring)."""
    codes, scales = codec.quantize(weight, group)
    owner.register_buffer(f"{name}_{codec.name}", codes, persistent=False)
    owner.register_buffer(f"{name}_scale", scales, persistent=False)
    record = QuantizedWeights(owner, name, params, weight.dtype, tuple(codes.shape), codec)
    for p in params:
        p.quantized_base = record
    record.release()
    owner.register_forward_pre_hook(_pre_hook(record), prepend=True)
    owner.register_forward_hook(_post_hook(record))
    return record


@torch.no_grad()
def merge(param, delta: torch.Tensor) -> None:
    """Give a quantized `param` real data: its dequantized weight + `delta` (set_merged)."""
    record: QuantizedWeights = param.quantized_base
    param.data = (record.values(record.index_of(param)).float() + delta).to(record.dtype)
    record.merged = True


def unmerge(param) -> None:
    param.quantized_base.merged = False
    param.quantized_base.release()


@dataclass
class QuantizationError:
    """sum |W - W'|^2 and sum |W|^2 of one kind of weight (over this rank's)."""

    error: float = 0.0
    norm: float = 0.0

    def add(self, weight: torch.Tensor, record: QuantizedWeights) -> None:
        w = weight.detach().float()
        self.error += float((w - record.values().float()).square().sum())
        self.norm += float(w.square().sum())

    @property
    def relative(self) -> float:
        return math.sqrt(self.error / self.norm) if self.norm else 0.0
