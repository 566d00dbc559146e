"""`lightning-mcore export`: a MegatronStrategy checkpoint to a Hugging Face directory.

Needs no training code: the checkpoint's common.pt names the model config and HF family, the
model is rebuilt in this process as one unsharded stage on CPU (gloo, world size 1) and
dist_checkpointing reshards whatever layout the checkpoint was saved with into it.

    lightning-mcore export --checkpoint runs/x/last.ckpt --output hf-out
    lightning-mcore export --checkpoint runs/x/last.ckpt --output adapter --mode peft \
        --lora_experts_layout per_expert
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Literal, Optional

import torch.distributed as dist
from jsonargparse import ActionYesNo, ArgumentParser
from megatron.core import parallel_state, tensor_parallel

from lightning_mcore import models
from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.export import export_hf
from lightning_mcore.hf.export_dir import ExportTargetError, check_target
from lightning_mcore.hf.load import load_hf_weights
from lightning_mcore.hf.peft_export import PeftExportError, export_peft
from lightning_mcore.hf.score_head import reward_weights
from lightning_mcore.lora.adapters import apply_lora, set_merged
from lightning_mcore.lora.config import saved_lora
from lightning_mcore.model.build import build_chunks
from lightning_mcore.model.config import to_transformer_config
from lightning_mcore.objectives import reward
from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.checkpoint_io import CheckpointLoadError
from lightning_mcore.strategy.cpu import CpuCompat, cuda_on_cpu
from lightning_mcore.strategy.nonfinite import refuse_nonfinite_weights
from lightning_mcore.strategy.parallel import ParallelConfig
from lightning_mcore.strategy.teardown import destroy_model_parallel


@contextlib.contextmanager
def single_process_megatron():
    """torch.distributed + mcore parallel_state for one CPU process, torn down afterwards."""
    if dist.is_initialized():
        raise RuntimeError(
            "export_checkpoint starts its own single-process group; call it outside a "
            "distributed run (e.g. `lightning-mcore export`), or use the HFExport callback in one."
        )
    compat = CpuCompat()
    compat.install()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True,
                                                        force_reset_rng=True)
        yield
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()
        compat.uninstall()


def export_checkpoint(
    checkpoint: str,
    output: str,
    source: Optional[str] = None,
    mode: Literal["merged", "peft"] = "merged",
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    lora_experts_layout: Optional[Literal["fused", "per_expert"]] = None,
) -> Path:
    """Write the model of a MegatronStrategy checkpoint as a Hugging Face directory.

    Args:
        checkpoint: a checkpoint directory written by MegatronStrategy (e.g. ``last.ckpt``).
        output: the HF directory to write (written to a temporary name, then renamed).
        source: an HF directory whose tokenizer and generation config are copied (and, for a
            LoRA run, whose weights are the base); defaults to the one the run started from.
            One that is not a directory is refused (never silently left out).
        mode: for a LoRA run, "merged" (full model, adapters merged) or "peft" (the adapter).
        max_shard_bytes: size limit of each ``model-0000N-of-0000M.safetensors`` shard.
        overwrite: replace an earlier lightning-mcore export at ``output``; anything else
            there (other files, the checkpoint itself) is never replaced.
        lora_experts_layout: with mode "peft", how LoRA adapters on MoE routed experts are
            written: "fused" (default; peft's target_parameters on transformers 5's fused 3-D
            experts, what PeftModel.from_pretrained loads) or "per_expert" (one lora_A/lora_B per
            expert linear, ...mlp.experts.<e>.gate_proj.lora_A.weight: the names vLLM loads).
    """
    saved = checkpoint_io.read_saved_model(checkpoint, "--checkpoint")  # clear errors before any set-up
    if source is not None and not Path(source).expanduser().is_dir():
        missing = "" if Path(source).expanduser().exists() else " (nothing is there)"
        raise HFCheckpointError(
            f"--source {source} is not a directory{missing}: "
            f"pass the Hugging Face directory the run started from (its tokenizer and generation "
            f"config are copied), or leave --source out to use the one the checkpoint records "
            f"({saved.hf_path}).")
    if source is None and saved.hf_path and Path(saved.hf_path).is_dir():
        source = saved.hf_path
    if mode == "peft" and not saved.lora:
        raise checkpoint_io.CheckpointLoadError(
            f"--checkpoint {checkpoint} is not from a LoRA run: export it with --mode merged (the "
            f"default), which writes the whole model.")
    base = saved.init_checkpoint or source
    if saved.lora and not (base and Path(base).is_dir()):
        raise checkpoint_io.CheckpointLoadError(
            f"{checkpoint} holds LoRA adapters only; its base ({base}) is not there: pass "
            f"--source with the HF directory the run started from."
        )
    protected = [checkpoint, source, saved.hf_path, saved.init_checkpoint]
    weights = models.weights(saved.config, saved.hf_family)
    if saved.head == "score":  # a reward model: the family's ...ForSequenceClassification layout

        weights = reward_weights(weights, saved.config.hidden_size)
        hf_config = reward.seq_cls_export_config(saved.config, saved.hf_family, source, saved.tokenizer_path)
    else:
        hf_config = models.export_config(saved.config, saved.hf_family, source)
    lora = saved_lora(saved.lora) if saved.lora else None
    layout = models.export_layout(saved.config, saved.hf_family, lora, mode, lora_experts_layout)
    check_target(output, overwrite, protected)  # before any work; export_* check it again
    with single_process_megatron(), cuda_on_cpu():
        tf_config = to_transformer_config(saved.config, ParallelConfig(), saved.dtype,
                                          on_cpu=True, use_te=False)
        chunks = build_chunks(saved.config, tf_config, use_te=False, padded_vocab=saved.padded_vocab_size)
        # a vision-language model's encoder sits beside the decoder (its weights are in the table)
        models.attach_vision_encoders(chunks, saved.config, saved.hf_family)
        if saved.head == "score":
            reward.attach_score_heads(chunks)
        if saved.lora:
            _load_base(chunks, saved, base, weights)
            apply_lora(chunks, lora, seed=0)
        checkpoint_io.load_model(checkpoint, chunks)
        refuse_nonfinite_weights(chunks, "cpu", f"the HF export {output}")
        if mode == "peft":
            peft_weights, scope = models.peft_weights(saved.config, saved.hf_family)
            export_peft(chunks, saved.config, peft_weights, lora, output,
                        base_model=saved.hf_path, overwrite=overwrite, protected=protected,
                        tokenizer_dir=source or saved.tokenizer_path,
                        fused_experts=models.peft_experts(saved.config, saved.hf_family), experts=layout,
                        scope=scope)
        else:
            set_merged(chunks, True)
            export_hf(chunks, saved.config, weights,
                      hf_config,
                      output, saved.padded_vocab_size,
                      source_dir=source, max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                      tokenizer_dir=saved.tokenizer_path, protected=protected,
                      carried=models.carried(saved.hf_family, source),
                      lora_base_precision=lora.base_precision if lora else None)
    return Path(output).expanduser().resolve()


def _load_base(chunks, saved, base, weights) -> None:
    if checkpoint_io.is_checkpoint(base):
        checkpoint_io.load_model(base, chunks)
    else:
        load_hf_weights(chunks, base, saved.config, weights, saved.padded_vocab_size,
                        carried=models.carried(saved.hf_family, base))


def describe(directory: Path) -> str:
    """One line on what an export holds: its files and their total size."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    return f"{directory} ({len(files)} files, {size / 2**20:.1f} MiB): " + ", ".join(p.name for p in files)


def main(args=None) -> None:
    parser = ArgumentParser(prog="lightning-mcore export", description=export_checkpoint.__doc__.split("\n")[0])
    parser.add_function_arguments(export_checkpoint, skip={"overwrite"}, as_positional=False)
    parser.add_argument("--overwrite", action=ActionYesNo, default=False,
                        help="replace an earlier lightning-mcore export at --output; anything else "
                             "there (other files, the checkpoint itself) is never replaced.")
    config = parser.parse_args(args)
    try:
        written = export_checkpoint(**{k: v for k, v in vars(config).items() if k != "config"})
    except (CheckpointLoadError, ExportTargetError, HFCheckpointError, PeftExportError) as error:
        # a user mistake: one line and exit code 2, as `fit` ends on a config mistake
        print(f"lightning-mcore export: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"lightning-mcore export: wrote {describe(written)}")


if __name__ == "__main__":
    main()
