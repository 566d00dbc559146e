"""`lightning-mcore` command: LightningCLI over our modules, data modules and strategy.

    lightning-mcore fit --config configs/quickstart.yaml
    lightning-mcore fit --config configs/quickstart.yaml --trainer.max_steps 10
    lightning-mcore fit --config configs/quickstart.yaml --print_config
    lightning-mcore export --checkpoint runs/x/last.ckpt --output hf-out

Config mistakes end with `error: ...` naming the key and exit code 2, without a traceback:
unknown keys and wrong types (jsonargparse), parallel layouts that cannot work with the world
size or the model's shape (checked here, before `fit` starts any process), and invalid values
refused by the library's own classes while they are built (e.g. a model path that is not an
HF directory, LoRA rank 0).
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import Any, NoReturn, Optional

import lightning as L
from lightning.pytorch.cli import LightningCLI

from lightning_mcore.objectives.base import MegatronModule
from lightning_mcore.strategy.parallel import LayoutError

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
EXPORT_HELP = ("export: a checkpoint to a Hugging Face directory (no Trainer, no training code): "
               "lightning-mcore export --checkpoint runs/x/last.ckpt --output hf-out "
               "[--mode peft] [--overwrite]; see lightning-mcore export --help.")


class MegatronCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        super().__init__(
            model_class=MegatronModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"epilog": EXPORT_HELP},
            args=args,
            run=run,
            **kwargs,
        )

    def instantiate_classes(self) -> None:
        """Build everything, then check the parallel layout against the world size *and* the
        model's shape here, in the launching process: `fit` would otherwise find a shape
        mistake only after its processes have started."""
        try:
            super().instantiate_classes()
        except Exception as error:  # noqa: BLE001 - re-raised unless it is a config mistake
            root = _root_cause(error)
            if isinstance(root, LayoutError):
                self._layout_error(root)
            where = _config_error_source(root)
            if where is None:
                raise
            self._error(f"{where}: {root}", root)
        from lightning_mcore.strategy.megatron import MegatronStrategy

        strategy = self.trainer.strategy
        if isinstance(strategy, MegatronStrategy):
            try:
                strategy.validate_module(self.model)
            except LayoutError as error:
                self._layout_error(error)
        self._check_export_targets()

    def _check_export_targets(self) -> None:
        """A fresh `fit` whose HFExport would meet an earlier export stops here, not after its
        workers have started (a resumed run checks once it knows its step: HFExport)."""
        from lightning_mcore.callbacks.hf_export import HFExport
        from lightning_mcore.hf.export_dir import ExportTargetError

        if self.subcommand != "fit" or self._get(self.config, "ckpt_path"):
            return
        for callback in self.trainer.callbacks:
            if isinstance(callback, HFExport):
                try:
                    callback.check_targets(0, self.trainer.max_steps)
                except ExportTargetError as error:
                    self._error(f"trainer.callbacks (HFExport, dirpath={callback.dirpath}): {error}", error)

    def instantiate_trainer(self, **kwargs):
        """Our progress bar and model summary where the config left Lightning's defaults."""
        from lightning_mcore.callbacks.console import default_console

        options = self._get(self.config_init, "trainer", default={})
        given = options.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        return super().instantiate_trainer(**default_console(options, given), **kwargs)

    # ------------------------------------------------------------------ errors
    def _error(self, message: str, cause: Optional[BaseException] = None) -> NoReturn:
        """`error: message` with the (sub)command's usage on stderr, exit code 2."""
        self._parser(self.subcommand).error(message, cause)

    def _layout_error(self, error: LayoutError) -> NoReturn:
        keys = self._layout_keys(error)
        where = f" ({', '.join(keys)})" if keys else ""
        self._error(f"invalid parallel layout{where}: {error}", error)

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
        model_config = getattr(getattr(self, "model", None), "model_config", None)
        model = self._get(self.config, "model")
        init_args = (model.get("init_args") if model is not None else None) or {}
        source, overrides = init_args.get("model"), init_args.get("model_overrides") or {}
        for field in error.fields:
            value = getattr(model_config, field, None)
            if field in overrides:
                keys.append(f"model.init_args.model_overrides.{field}={value}")
            elif isinstance(source, (str, os.PathLike)):
                keys.append(f"model.init_args.model={source} ({field}={value} in it)")
            else:
                keys.append(f"model.init_args.model.{field}={value}")
        return keys


_MISSING = object()


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
    if not isinstance(error, (ValueError, TypeError, OSError)):
        return None
    frames, tb, tb_last = [], error.__traceback__, None
    while tb is not None:
        frames.append(tb.tb_frame)
        tb_last, tb = tb, tb.tb_next
    if not frames or not os.path.abspath(frames[-1].f_code.co_filename).startswith(_PACKAGE_DIR):
        return None
    # A deliberate refusal (`raise ...Error(...)` in our code), not an accident (a bug).
    if not linecache.getline(frames[-1].f_code.co_filename, tb_last.tb_lineno).lstrip().startswith("raise"):
        return None
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import Strategy

    from lightning_mcore.hf.config import HFCheckpointError
    from lightning_mcore.model.config import GPTConfig
    from lightning_mcore.model.lora import LoRAConfig
    from lightning_mcore.strategy.checkpoint_io import CheckpointOptions
    from lightning_mcore.strategy.optimizer import OptimizerSettings

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
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["export"]:  # a checkpoint to an HF directory: no Trainer, no training code
        from lightning_mcore.hf.from_checkpoint import main as export_main

        return export_main(argv[1:])
    MegatronCLI(args=args)


if __name__ == "__main__":
    main()
