"""Every config in configs/ parses and instantiates (trainer, strategy, module, data module)
short of building the model; a wrong key fails naming the key."""

import os
from pathlib import Path

import pytest

from lightning_mcore.cli import MegatronCLI

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


@pytest.fixture(autouse=True)
def no_leaked_seed():
    """`seed_everything:` in a config sets PL_GLOBAL_SEED / PL_SEED_WORKERS in os.environ; forked
    ranks of later tests would inherit them (and train differently). Restored after each test."""
    names = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.mark.parametrize("name", CONFIGS)
def test_config_instantiates(name, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    cli = MegatronCLI(args=["--config", f"configs/{name}", "--trainer.logger", "false",
                            "--data.init_args.cache_dir", str(tmp_path)], run=False)
    from lightning_mcore import MegatronModule, MegatronStrategy

    assert isinstance(cli.model, MegatronModule) and cli.model.chunks is None
    assert isinstance(cli.trainer.strategy, MegatronStrategy)
    assert cli.datamodule is not None


def test_wrong_key_is_named(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        MegatronCLI(args=["--config", "configs/sft.yaml", "--model.init_args.optim.learning_rate", "1"],
                    run=False)
    assert "learning_rate" in capsys.readouterr().err
