"""The seam to Megatron-Core's inference internals (model/inference_context.py): no other module
of the package reaches them, so that replacing mcore's deprecated static context is one file;
and what the seam does with mcore's context (buffers kept per layer, prefill then decode)."""

import re
from pathlib import Path

import torch

from lightning_mcore.model import inference_context as ic

PACKAGE = Path(__file__).parents[1] / "lightning_mcore"
INTERNALS = re.compile(r"megatron\.core\.inference|key_value_memory_dict|sequence_len_offset|"
                       r"enable_(decode|prefill)_mode|InferenceMode|StaticInferenceContext")


def test_only_the_seam_touches_mcore_inference_internals():
    touching = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                      if INTERNALS.search(p.read_text()))
    assert touching == ["model/inference_context.py"], touching


def test_seam_keeps_buffers_and_moves_from_prefill_to_decode():
    context = ic.new_context(rows=3, max_length=16)
    keys, values = torch.zeros(16, 3, 2, 8), torch.zeros(16, 3, 2, 8)
    ic.keep_buffers(context, 1, (keys, values))
    assert ic.buffers(context, 1)[0] is keys and ic.buffers(context, 1)[1] is values
    ic.go_to(context, 0)
    assert ic.position(context) == 0 and not context.is_decode_only()
    ic.go_to(context, 5)
    assert ic.position(context) == 5 and context.is_decode_only()
    ic.go_to(context, 0)  # a kept context starts a new prefill
    assert not context.is_decode_only()
    from megatron.core.inference.utils import InferenceMode

    with ic.inference_mode():
        assert InferenceMode.is_active()
    assert not InferenceMode.is_active()
