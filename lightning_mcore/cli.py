"""`lightning-mcore` command: LightningCLI over our modules, data modules and strategy.

    lightning-mcore fit --config configs/quickstart.yaml
    lightning-mcore fit --config configs/quickstart.yaml --trainer.max_steps 10
    lightning-mcore fit --config configs/quickstart.yaml --print_config
    lightning-mcore export --checkpoint runs/x/last.ckpt --output hf-out
"""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI

from lightning_mcore.objectives.base import MegatronModule


class MegatronCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        super().__init__(
            model_class=MegatronModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
            **kwargs,
        )


def main(args=None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["export"]:  # a checkpoint to an HF directory: no Trainer, no training code
        from lightning_mcore.hf.from_checkpoint import main as export_main

        return export_main(argv[1:])
    MegatronCLI(args=args)


if __name__ == "__main__":
    main()
