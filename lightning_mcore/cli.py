"""`lightning-mcore` command: LightningCLI over our modules, data modules and strategy.

    lightning-mcore fit --config configs/quickstart.yaml
    lightning-mcore fit --config configs/quickstart.yaml --trainer.max_steps 10
    lightning-mcore fit --config configs/quickstart.yaml --print_config
    lightning-mcore export --checkpoint runs/x/last.ckpt --output hf-out
    lightning-mcore verify --model hf-dir --tensor_model_parallel_size 2
    lightning-mcore preprocess --input corpus.jsonl --tokenizer tok-dir --output-prefix data/corpus
    lightning-mcore plan --config configs/llama3_8b_sft.yaml --gpu_memory 80GiB

Config mistakes end with `error: ...` naming the key and exit code 2, without a traceback:
unknown keys and wrong types (jsonargparse's report in one line with the closest valid names,
cli_errors.py; options are never abbreviated, and the optimizer is the module's OptimizerSettings,
not LightningCLI's --optimizer), parallel layouts that cannot work with the world
size or the model's shape (checked here, before `fit` starts any process), and invalid values
refused by the library's own classes while they are built (e.g. a model path that is not an
HF directory, LoRA rank 0, a data file without the fields its format needs). Also checked here:
the data's seq_length against the model's, the precision, the HF weights' file headers,
`--ckpt_path` (a checkpoint directory of this very model; `last` only where there is one,
`last-if-any` resumes it or starts afresh), a YAML key given twice (config_yaml.py), and the
checkpoint directories, which a `fit` holds while it runs (checkpoint_dirs.py: one that cannot
be written, or that another run is writing into, is refused).

What can only fail once the ranks run (a damaged checkpoint shard, a text shorter than one
sequence, a NaN loss, a full disk) ends with one `error: ...` line from rank 0 and exit code 1
(refusals.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import Strategy

from lightning_mcore import checkpoint_dirs, cli_errors, config_yaml
from lightning_mcore.callbacks.console import default_console
from lightning_mcore.callbacks.hf_export import HFExport
from lightning_mcore.data.preprocess import main as preprocess_main
from lightning_mcore.export_checkpoint import main as export_main
from lightning_mcore.hf.checkpoint import CheckpointError, open_safetensors, weight_map
from lightning_mcore.hf.config import HFCheckpointError
from lightning_mcore.hf.export_dir import ExportTargetError
from lightning_mcore.hf.peft_export import PeftExportError
from lightning_mcore.lora.checks import LoRAPlanError
from lightning_mcore.lora.config import LoRAConfig
from lightning_mcore.model.config import GPTConfig
from lightning_mcore.models import gpt_config_from_hf
from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.plan.memory import MemoryPlan, largest_micro_batch, memory_plan
from lightning_mcore.plan.parameters import PlanError
from lightning_mcore.plan.run import plan_inputs
from lightning_mcore.plan.table import parse_bytes, plan_table
from lightning_mcore.refusals import deliberate, report_refusals, traceback_frames
from lightning_mcore.strategy import checkpoint_io
from lightning_mcore.strategy.checkpoint_io import CheckpointOptions
from lightning_mcore.strategy.forked_ranks import ending_forked_rank
from lightning_mcore.strategy.megatron import MegatronStrategy, precision_dtype
from lightning_mcore.strategy.optimizer import OptimizerSettings
from lightning_mcore.strategy.parallel import LayoutError
from lightning_mcore.verify import main as verify_main

EXPORT_HELP = ("export: a checkpoint to a Hugging Face directory (no Trainer, no training code): "
               "lightning-mcore export --checkpoint runs/x/last.ckpt --output hf-out "
               "[--mode peft] [--overwrite]; see lightning-mcore export --help. "
               "verify: an HF checkpoint in our model against transformers: lightning-mcore verify "
               "--model hf-dir [--tensor_model_parallel_size 2 ...]; see lightning-mcore verify --help. "
               "preprocess: text to mcore indexed .bin/.idx files: lightning-mcore preprocess --input "
               "corpus.jsonl --tokenizer tok-dir --output-prefix data/corpus; see lightning-mcore "
               "preprocess --help. plan: the per-GPU memory of a config, without a GPU: lightning-mcore plan "
               "--config x.yaml [--gpu_memory 80GiB]; see lightning-mcore plan --help.")

DESCRIPTION = ("Subcommands: fit, validate, test, predict (a Lightning Trainer on a config); export, "
               "verify, preprocess, plan (described below).")


class MegatronCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        super().__init__(
            model_class=MegatronModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"epilog": EXPORT_HELP, "description": DESCRIPTION},
            auto_configure_optimizers=False,  # the module's OptimizerSettings own the optimizer
            args=args,
            run=run,
            **kwargs,
        )

    def init_parser(self, **kwargs: Any):
        """Every parser (the main one and each subcommand's) loads YAML refusing a key given
        twice (config_yaml.py), which YAML would silently resolve to the last."""
        kwargs.setdefault("parser_mode", config_yaml.MODE)
        kwargs.setdefault("allow_abbrev", False)  # `--trainer.max_step` is a typo, not max_steps
        return super().init_parser(**kwargs)

    def instantiate_classes(self) -> None:
        """Build everything, then check the parallel layout against the world size *and* the
        model's shape here, in the launching process: `fit` would otherwise find a shape
        mistake only after its processes have started."""
        try:
            super().instantiate_classes()
        except Exception as error:  # noqa: BLE001 - re-raised unless it is a config mistake
            self._instantiation_error(error)
        strategy = self.trainer.strategy
        if isinstance(strategy, MegatronStrategy):
            self._checked(strategy.validate_module, self.model)

    def _instantiation_error(self, error: Exception) -> None:
        """A config mistake met while the classes were built as one `error:` line; anything
        else (a bug) re-raised with its traceback."""
        root = _root_cause(error)
        if isinstance(root, LayoutError):
            self._layout_error(root)
        where = _config_error_source(root)
        if where is None:
            raise error
        self._error(f"{where}: {root}", root)

    def _checked(self, check, *args) -> Any:
        """`check(*args)`, its layout or LoRA refusal as an `error:` line naming the keys."""
        try:
            return check(*args)
        except LayoutError as error:
            self._layout_error(error)
        except LoRAPlanError as error:
            keys = [f"model.init_args.lora.{f}={getattr(self.model.lora, f)}" for f in error.lora]
            self._error(f"invalid LoRA setting ({', '.join(keys + self._layout_keys(error))}): {error}", error)

    def _check_export_targets(self) -> None:
        """A fresh `fit` whose HFExport would meet an earlier export stops here, not after its
        workers have started (a resumed run checks once it knows its step: HFExport)."""
        if self.subcommand != "fit":
            return
        resumed = self._get(self.config, "ckpt_path")
        for callback in self.trainer.callbacks:
            if isinstance(callback, HFExport):
                try:
                    if callback.mode != "full" and getattr(self.model, "lora", None) is not None:
                        self.model.check_hf_export(callback.mode, callback.lora_experts_layout)
                    if not resumed:
                        callback.check_targets(0, self.trainer.max_steps)
                except (ExportTargetError, HFCheckpointError, PeftExportError) as error:
                    self._error(f"trainer.callbacks (HFExport, dirpath={callback.dirpath}): {error}", error)

    def instantiate_trainer(self, **kwargs):
        """Our progress bar and model summary where the config left Lightning's defaults."""
        options = self._get(self.config_init, "trainer", default={})
        given = options.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        trainer = super().instantiate_trainer(**default_console(options, given), **kwargs)
        if hasattr(trainer.strategy, "fork_ranks"):  # a CLI run makes one Trainer call
            trainer.strategy.fork_ranks()
        return trainer

    def parse_arguments(self, parser, args) -> None:
        """Parse, then refuse a `ckpt_path` that is not a checkpoint directory (Lightning would
        otherwise read a file given there as one of its own checkpoints) and a checkpoint given
        as `model` whose common.pt cannot be read (the module reads it while it is built).
        jsonargparse's own errors become one line (cli_errors.py)."""
        subparsers = self._subcommand_parsers_by_name()
        parsers = [parser, *subparsers.values()]
        for each in parsers:
            each.exit_on_error = False
        try:
            super().parse_arguments(parser, args)
            failed = None
        except argparse.ArgumentError as error:
            failed = error
        finally:
            for each in parsers:
                each.exit_on_error = True
        if failed is not None:
            argv = sys.argv[1:] if args is None else [str(a) for a in args]
            sub = next((a for a in argv if a in subparsers), None)
            options = (subparsers[sub] if sub else parser)._option_string_actions
            self._error(cli_errors.one_line(str(failed), argv, options), subcommand=sub)
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return

        path = self.config[subcommand].get("ckpt_path")
        if _is_path(path) and not Path(path).exists():
            self._error(f"ckpt_path={path} does not exist.", subcommand=subcommand)
        if _is_path(path) and not checkpoint_io.is_checkpoint(path):
            self._error(f"ckpt_path={path} is not a MegatronStrategy checkpoint (a directory holding "
                        f"common.pt and weights/, e.g. runs/x/checkpoints/last.ckpt).", subcommand=subcommand)
        source = self.config[subcommand].get("model.init_args.model")
        if isinstance(source, (str, os.PathLike)) and checkpoint_io.is_checkpoint(source):
            self._read_checkpoint(f"model.init_args.model={source}", Path(source),
                                  checkpoint_io.read_saved_model, subcommand)

    def _subcommand_parsers_by_name(self) -> dict:
        """{subcommand: its parser}; none where the CLI was built with run=False."""
        try:
            return {name: self._parser(name) for name in self.subcommands()}
        except (AttributeError, KeyError):
            return {}

    def after_instantiate_classes(self) -> None:
        """What the built objects can still tell before any worker starts: the precision, the
        data's row length against the model's (and the model's against its HF config), the HF
        weights' files, that a checkpoint to resume holds this model, and that a fresh run's
        HFExport meets no earlier export."""
        strategy, module = self.trainer.strategy, self.model
        if not isinstance(strategy, MegatronStrategy) or not isinstance(module, MegatronModule):
            return
        try:
            strategy.dtype
        except ValueError as error:
            self._error(f"trainer.precision={self._get(self.config, 'trainer').get('precision')}: {error}")
        self._check_seq_length(module)
        self._check_hf_source(module)
        path = self._resume_path() if self.subcommand else None
        if _is_path(path):
            tp = strategy.parallel.tensor_model_parallel_size
            self._read_checkpoint(f"ckpt_path={path}", Path(path),
                                  lambda p: checkpoint_io.read_resumed(p, module.model_config, tp,
                                                                       getattr(module, "lora", None)))
        self._check_data_tokenizer(module)
        self._check_prompt_room(module)
        self._check_export_targets()

    def _resume_path(self) -> Any:
        """`ckpt_path`, "last" and LAST_IF_ANY resolved here to the checkpoint Lightning's "last"
        resumes (checkpoint_dirs.last_checkpoint), which the subcommand then gets. Where there is
        none, "last" is refused (Lightning would warn and train from step 0) and LAST_IF_ANY
        starts afresh."""
        path = self._get(self.config, "ckpt_path")
        if path not in ("last", LAST_IF_ANY):
            return path
        found = checkpoint_dirs.last_checkpoint(self.trainer)
        if found is None and path == "last":
            dirs = " or ".join(checkpoint_dirs.checkpoint_dirs(self.trainer)) or "(the trainer has no ModelCheckpoint)"
            self._error(f"ckpt_path=last: there is no checkpoint to resume in {dirs}, and Lightning "
                        f"would train from step 0. Give a checkpoint's path, leave ckpt_path out to "
                        f"start afresh, or pass --ckpt_path {LAST_IF_ANY} to resume only where a "
                        f"checkpoint exists (a job that may be requeued).")
        self.config_init[self.subcommand]["ckpt_path"] = found
        return found

    def _check_prompt_room(self, module: MegatronModule) -> None:
        """A module that generates (GRPO) needs room for its completions after the prompts."""
        length = getattr(getattr(self, "datamodule", None), "max_prompt_length", None)
        if hasattr(module, "check_prompt_length") and isinstance(length, int):
            try:
                module.check_prompt_length(length, f"data.init_args.max_prompt_length={length}")
            except ValueError as error:
                self._error(f"model.init_args.max_completion_length: {error}", error)

    def _check_data_tokenizer(self, module: MegatronModule) -> None:
        """A module that reads a second model (a distillation teacher) checks its tokenizer."""
        tokenizer = (getattr(getattr(self, "datamodule", None), "hparams", None) or {}).get("tokenizer")
        if hasattr(module, "check_tokenizer") and isinstance(tokenizer, str):
            try:
                module.check_tokenizer(tokenizer, f"the data's (data.init_args.tokenizer={tokenizer})")
            except ValueError as error:
                self._error(f"model.init_args.teacher: {error}", error)

    def _check_seq_length(self, module: MegatronModule) -> None:
        data = getattr(getattr(self, "datamodule", None), "hparams", None) or {}
        # prompt data (GRPO's) sets its rows' length as max_prompt_length
        option = "max_prompt_length" if "max_prompt_length" in data else "seq_length"
        rows, model = data.get(option), module.model_config.seq_length
        if isinstance(rows, int) and rows > model:
            self._check_prompt_room(module)  # a module that generates: what must fit besides
            self._error(
                f"data.init_args.{option}={rows} is longer than the model's seq_length "
                f"({self._model_key('seq_length', model)}): rows longer than the model are not "
                f"computed as configured. Set data.init_args.{option} <= {model}, or raise the "
                f"model's seq_length (model.init_args.model_overrides.seq_length for an HF model)."
            )

    def _check_hf_source(self, module: MegatronModule) -> None:
        """The HF directory behind the model: every safetensors file it will read is there with
        a complete header; a model fine-tuned from one of our checkpoints still fits its
        config.json (seq_length within max_position_embeddings, the same sliding windows)."""
        source = module.hf_path
        if source is None or not Path(source).is_dir():
            return
        key = f"model.init_args.model={module.init_checkpoint or source}"
        try:
            if module.init_checkpoint is not None:
                hf_model, _ = gpt_config_from_hf(source, seq_length=module.model_config.seq_length)
                self._check_windows(key, hf_model, module.model_config, source)
                return
            for file in sorted(set(weight_map(Path(source)).values())):
                with open_safetensors(file):
                    pass
        except (CheckpointError, HFCheckpointError) as error:
            self._error(f"{key}: {error}", error)

    def _check_windows(self, key: str, hf_model, model, source) -> None:
        """A checkpoint saved before sliding windows were computed records none: beyond the
        window its model would attend where the HF model it came from does not."""
        def windows(cfg):
            return [cfg.sliding_window if cfg.is_window_layer(i) else None for i in range(cfg.num_layers)]

        if hf_model.uses_sliding_window() and windows(hf_model) != windows(model):
            self._error(
                f"{key} has sliding_window={model.sliding_window}, layer_types={model.layer_types}, "
                f"but the Hugging Face model it came from ({Path(source) / 'config.json'}) has "
                f"sliding_window={hf_model.sliding_window}, layer_types={hf_model.layer_types}: set "
                f"them in model.init_args.model_overrides (or seq_length <= {hf_model.sliding_window})."
            )

    def _read_checkpoint(self, key: str, path: Path, read, subcommand: Optional[str] = None) -> None:
        """`read(path)` (checkpoint_io's), its refusal or any failure to read common.pt as an
        error naming `key`."""
        try:
            read(path)
        except checkpoint_io.CheckpointLoadError as error:  # its message names the path
            named = str(error).startswith(key.split("=")[0])
            self._error(str(error) if named else f"{key}: {error}", error, subcommand)
        except Exception as error:  # noqa: BLE001 - an unreadable file, whatever torch.load says
            self._error(f"{key}: {path / checkpoint_io.COMMON} cannot be read ({type(error).__name__}: "
                        f"{error}); the checkpoint is incomplete or damaged.", error, subcommand)

    # ------------------------------------------------------------------ run
    # LightningCLI runs `self.<subcommand>` where the CLI defines one.
    def fit(self, **kwargs: Any) -> None:
        with self._checkpoint_dirs_held():
            report_refusals(self.trainer, self.trainer.fit, **kwargs)

    def _checkpoint_dirs_held(self) -> contextlib.ExitStack:
        """The run's checkpoint directories, held by this (the launching) process until it ends:
        a directory another run holds, or one it cannot write, is refused before any worker
        starts (checkpoint_dirs.py)."""
        stack = contextlib.ExitStack()
        if not checkpoint_dirs.launching_rank_zero(self.trainer):
            return stack
        try:
            stack.enter_context(checkpoint_dirs.held(checkpoint_dirs.checkpoint_dirs(self.trainer)))
        except checkpoint_dirs.CheckpointDirError as error:
            self._error(f"trainer.callbacks (ModelCheckpoint): {error}", error)
        return stack

    def validate(self, **kwargs: Any) -> None:
        report_refusals(self.trainer, self.trainer.validate, **kwargs)

    def test(self, **kwargs: Any) -> None:
        report_refusals(self.trainer, self.trainer.test, **kwargs)

    def predict(self, **kwargs: Any) -> None:
        report_refusals(self.trainer, self.trainer.predict, **kwargs)

    # ------------------------------------------------------------------ errors
    def _error(self, message: str, cause: Optional[BaseException] = None,
               subcommand: Optional[str] = None) -> NoReturn:
        """`error: message` on stderr, exit code 2. A value the parser took but the run cannot
        use: a pointer to --help, not the 50-line usage that would bury the message."""
        parser = self._parser(subcommand or getattr(self, "subcommand", None))
        if not parser.exit_on_error:
            parser.error(message, cause)
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"tip: the options are listed by: {prog} --help\nerror: {message}\n")
        raise SystemExit(2)

    def _layout_error(self, error: LayoutError) -> NoReturn:
        keys = self._layout_keys(error)
        where = f" ({', '.join(keys)})" if keys else ""
        self._error(f"invalid {error.what}{where}: {error}", error)

    def _layout_keys(self, error: LayoutError) -> list[str]:
        """`key=value` for each config key behind the settings the error names."""
        config = self._get(self.config, "trainer") or {}
        init = self._get(getattr(self, "config_init", None) or {}, "trainer") or {}
        strategy = getattr(getattr(self, "trainer", None), "strategy", None) or init.get("strategy")
        keys = []
        for option in error.options:
            value = _strategy_value(strategy, option)
            keys.append(f"trainer.strategy.init_args.{option}" + ("" if value is _MISSING else f"={value}"))
        if error.devices:
            keys.append(f"trainer.devices={config.get('devices')}")
            keys.append(f"trainer.num_nodes={config.get('num_nodes')}")
        if error.accelerator:
            keys.append(f"trainer.accelerator={config.get('accelerator')}")
        if error.optimizer:
            optim = getattr(getattr(self, "model", None), "optim", None)
            keys.append(f"model.init_args.optim.optimizer={getattr(optim, 'optimizer', None)}")
        optim = getattr(getattr(self, "model", None), "optim", None)
        keys += [f"model.init_args.optim.{f}={getattr(optim, f, None)}" for f in getattr(error, "optim_fields", ())]
        keys += [f"model.init_args.{f}={getattr(getattr(self, 'model', None), f, None)}"
                 for f in getattr(error, "module_fields", ())]
        model_config = getattr(getattr(self, "model", None), "model_config", None)
        for field in error.fields:
            keys.append(self._model_key(field, getattr(model_config, field, None)))
        return keys

    def _model_key(self, field: str, value: Any) -> str:
        """`key=value` of a model config field: where the config sets it."""
        model = self._get(self.config, "model")
        init_args = (model.get("init_args") if model is not None else None) or {}
        source, overrides = init_args.get("model"), init_args.get("model_overrides") or {}
        if field in overrides:
            return f"model.init_args.model_overrides.{field}={value}"
        if isinstance(source, (str, os.PathLike)):
            return f"model.init_args.model={source} ({field}={value} in it)"
        return f"model.init_args.model.{field}={value}"


class PlanCLI(MegatronCLI):
    """`lightning-mcore plan --config X.yaml [--gpu_memory 80GiB]`: the config parsed by the
    parser `fit` uses (every key means what it means there), the module and the strategy built
    (not the data, callbacks, logger or Trainer; no process starts), the layout checks run for
    the config's own device and world size, and the per-GPU memory plan printed
    (lightning_mcore/plan/)."""

    def __init__(self, args=None) -> None:
        super().__init__(args=args, run=False)

    def init_parser(self, **kwargs: Any):
        kwargs.setdefault("prog", "lightning-mcore plan")
        kwargs["description"] = ("The per-GPU memory of a training config (weights, gradients, optimizer "
                                 "state, activations, logits, buffers), the largest micro batch that fits "
                                 "--gpu_memory, and the layout checks, without a GPU.")
        kwargs.pop("epilog", None)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--gpu_memory", type=str, default="80GiB",
                            help="The memory of one GPU, for the largest micro batch that fits (80GiB, 141GB, ...).")

    def before_instantiate_classes(self) -> None:
        """What the plan does not read is not built: the data module (whose files need not be
        on this machine; a plain LightningDataModule in its place), the callbacks and the logger."""
        self.config.data = Namespace(class_path="lightning.pytorch.LightningDataModule", init_args=Namespace())
        self.config.trainer.callbacks = None
        self.config.trainer.logger = None

    def instantiate_classes(self) -> None:
        try:
            self.config_init = self.parser.instantiate_classes(self.config)
        except Exception as error:  # noqa: BLE001 - re-raised unless it is a config mistake
            self._instantiation_error(error)
        self.model, self.datamodule = self._get(self.config_init, "model"), None

    def after_instantiate_classes(self) -> None:
        """The checks `fit` runs before launch, for the config's device; then the plan."""
        trainer = self._get(self.config, "trainer")
        strategy = self._get(self.config_init, "trainer").get("strategy")
        if not isinstance(strategy, MegatronStrategy):
            self._error(f"trainer.strategy={strategy}: the plan is for lightning_mcore.MegatronStrategy runs.")
        devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
        devices = len(devices) if isinstance(devices, (list, tuple)) else devices
        if not isinstance(devices, int) and not str(devices).isdigit():
            self._error(f"trainer.devices={devices}: the plan needs the number of devices per node.")
        world = int(devices) * int(nodes)
        on_gpu = trainer.get("accelerator") != "cpu"
        try:
            bf16 = precision_dtype(trainer.get("precision")) == torch.bfloat16
            gpu_bytes = parse_bytes(self._get(self.config, "gpu_memory"))
        except ValueError as error:
            key = "gpu_memory" if "memory size" in str(error) else "trainer.precision"
            self._error(f"{key}: {error}")
        cfg = self.model.model_config
        use_te = on_gpu and cfg.transformer_impl != "local"  # the GPU machine has TE, this one need not
        parallel = self._checked(strategy.check_run, self.model, world, "gpu" if on_gpu else "cpu", use_te)
        try:
            self.inputs = plan_inputs(strategy, self.model, parallel, world, bf16, on_gpu)
            self.plan = memory_plan(self.inputs)
        except PlanError as error:
            self._error(f"{self._model_key(error.fields[0], getattr(cfg, error.fields[0]))}: {error}", error)
        self.gpu_bytes, self.largest = gpu_bytes, largest_micro_batch(self.inputs, gpu_bytes)
        self.ranks = "GPUs" if on_gpu else "CPU ranks"

    def report(self) -> str:
        """The table `lightning-mcore plan` prints."""
        return (plan_table(self.inputs, self.plan, self.gpu_bytes, self.largest, self.ranks)
                + "\nlayout checks: passed (the checks fit runs before launch)")


def plan_config(config, *args: str, gpu_memory: str = "80GiB") -> MemoryPlan:
    """The memory plan of a config file (and command-line overrides `args`), as `lightning-mcore
    plan` computes it, for a notebook: `plan_config("configs/x.yaml").total` bytes per GPU. A
    config mistake ends as on the command line (`error:` on stderr, SystemExit(2))."""
    return PlanCLI(["--config", str(config), "--gpu_memory", gpu_memory, *args]).plan


_MISSING = object()
# `--ckpt_path last-if-any`: resume the last checkpoint where there is one, else start afresh
LAST_IF_ANY = "last-if-any"


def _is_path(ckpt_path: Any) -> bool:
    """A ckpt_path naming a directory, not one Lightning resolves itself ("last", "best", ...)."""
    return ckpt_path is not None and str(ckpt_path) not in ("last", "best", "hpc", LAST_IF_ANY) \
        and not str(ckpt_path).startswith("registry")


def _strategy_value(strategy: Any, option: str) -> Any:
    for part in ("parallel", "batch"):
        holder = getattr(strategy, part, None)
        if holder is not None and hasattr(holder, option):
            return getattr(holder, option)
    return _MISSING


def _root_cause(error: BaseException) -> BaseException:
    """The first exception of a chain (jsonargparse wraps errors from __init__ in its own)."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        nxt = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if nxt is None:
            break
        error = nxt
    return error


def _config_error_source(error: BaseException) -> Optional[str]:
    """Where an invalid value was refused, as a config key (`model`, `data.init_args`, ...),
    when `error` is a ValueError/TypeError/OSError that this library's code raised on purpose
    while the classes were built; None for anything else (a bug: keep its traceback)."""
    if not isinstance(error, (ValueError, TypeError, OSError)) or not deliberate(error):
        return None
    return _owner_key(error)


def _owner_key(error: BaseException) -> Optional[str]:
    """The config key of the innermost object of ours that `error` passed through, e.g.
    `data (SFTDataModule)`; None when there is none."""
    frames = [frame for frame, _ in traceback_frames(error)]

    owners = ((LoRAConfig, "model.init_args.lora"), (OptimizerSettings, "model.init_args.optim"),
              (GPTConfig, "model.init_args.model"),
              (CheckpointOptions, "trainer.strategy.init_args.checkpoint"),
              (L.LightningModule, "model"), (L.LightningDataModule, "data"),
              (Strategy, "trainer.strategy"), (Callback, "trainer.callbacks"),
              (Logger, "trainer.logger"))
    for frame in reversed(frames):  # innermost first
        owner = frame.f_locals.get("self")
        for cls, key in owners:
            if isinstance(owner, cls):
                if key == "model" and isinstance(error, HFCheckpointError):
                    key = "model.init_args.model"
                return f"{key} ({type(owner).__name__})"
    return None


def main(args=None) -> None:
    """One subcommand. A rank forked during it (on CPU, strategy/forked_ranks.py) ends here."""
    with ending_forked_rank():
        _run(args)


def _run(args) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["export"]:  # a checkpoint to an HF directory: no Trainer, no training code

        return export_main(argv[1:])
    if argv[:1] == ["verify"]:  # our model of an HF checkpoint against transformers'

        return verify_main(argv[1:])
    if argv[:1] == ["preprocess"]:  # text to mcore indexed .bin/.idx files

        return preprocess_main(argv[1:], prog="lightning-mcore preprocess")
    if argv[:1] == ["plan"]:  # the per-GPU memory of a config, without a GPU
        print(PlanCLI(args=argv[1:]).report())
        return None
    MegatronCLI(args=args)


def command() -> None:
    """The `lightning-mcore` program: `main` in a process of its own. What the imports made lives
    as long as the process, so it is frozen out of Python's garbage collector (gc.freeze): a full
    collection no longer walks torch's, Lightning's and mcore's ~10^6 objects during the run, nor
    three times more as the interpreter shuts down (2.6 s of the 16 s that
    `python -c "import lightning_mcore.cli"` took on the 2-core CI machine). Not in `main`: a
    caller's process (a notebook, a test session) keeps its own collector as it was."""
    gc.freeze()
    main()


if __name__ == "__main__":
    command()
