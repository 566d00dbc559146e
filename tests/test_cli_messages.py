"""The first minutes with the command (issue 48, part 3): every subcommand is named where a user
looks first, and a mistyped option ends in one `error:` line that names it and the closest valid
ones: no usage dump, no abbreviation silently taken, no `--optimizer` that crashes later."""

import dataclasses
import re
import shlex

import lightning as L
import pytest
import yaml
from readme import ROOT, section

from lightning_mcore.cli import main
from lightning_mcore.cli_errors import OPTIMIZER_HINT, SUBCOMMANDS
from lightning_mcore.strategy.optimizer import OptimizerSettings

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def refused(capsys, *argv: str) -> str:
    """In-process `lightning-mcore ARGV`: exit code 2 and exactly one `error:` line, which is
    returned; at most one other line (the pointer to --help)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and len(err) <= 2, err
    return errors[0]


def printed_config(capsys, *argv: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, *argv, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_no_subcommand_names_every_subcommand_and_each_one_runs(capsys):
    line = refused(capsys)
    assert line.endswith("the subcommands are " + ", ".join(SUBCOMMANDS))
    for name in SUBCOMMANDS:  # the list is the dispatch: each prints its own help
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code in (0, None), name
        assert "usage:" in capsys.readouterr().out, name


def test_a_mistyped_subcommand_gets_the_closest_one(capsys):
    assert refused(capsys, "fti").startswith("error: unknown subcommand 'fti': ")
    assert refused(capsys, "fti").endswith("did you mean fit?")


def test_an_abbreviated_option_is_refused_not_taken(capsys):
    """argparse would take `--trainer.max_step 1` as `--trainer.max_steps 1`: a run of the
    wrong length that looks right."""
    assert printed_config(capsys, "--trainer.max_steps", "1")["trainer"]["max_steps"] == 1
    line = refused(capsys, "fit", "--config", QUICKSTART, "--trainer.max_step", "1")
    assert "unknown option --trainer.max_step " in line and "did you mean --trainer.max_steps" in line


def test_a_nested_typo_names_the_class_and_the_closest_options(capsys):
    line = refused(capsys, "fit", "--config", QUICKSTART, "--model.init_args.optim.lrr", "1e-3")
    assert line == ("error: lightning_mcore.OptimizerSettings has no option 'lrr' (given as "
                    "--model.init_args.optim.lrr); did you mean lr?")
    assert printed_config(capsys, "--model.init_args.optim.lr", "1e-3")["model"]["init_args"]["optim"]["lr"] == 1e-3


def test_optimizer_options_are_refused_and_point_to_the_module_settings(capsys):
    """LightningCLI's --optimizer would build an optimizer over no parameters (the model is
    built later, on its device); the module's OptimizerSettings own the optimizer."""
    for flag in ("--optimizer", "--lr_scheduler"):
        line = refused(capsys, "fit", "--config", QUICKSTART, flag, "torch.optim.AdamW")
        assert line == f"error: unknown option {flag}: {OPTIMIZER_HINT}"
    assert "optimizer" not in printed_config(capsys) and "lr_scheduler" not in printed_config(capsys)
    named = OPTIMIZER_HINT.split(": ", 1)[1].rstrip(", ...)").split(", ")
    fields = {f.name for f in dataclasses.fields(OptimizerSettings)}
    assert named and set(named) <= fields, (named, fields)


class Launched(BaseException):
    """Raised where Trainer.fit would start the ranks: every check before launch passed."""


def spans(start: str, end: str) -> list[str]:
    """The inline code spans of the quickstart section's text from `start` to `end`."""
    text = section("The main job: quickstart")
    text = text[text.index(start):]
    return re.findall(r"`([^`]+)`", text[: text.index(end)])


def test_readme_overrides_work_as_shown(capsys, monkeypatch):
    """The README's override examples on the quickstart pass every check before launch and
    reach the trainer as given."""
    seen = []

    def fit(trainer, *args, **kwargs):
        strategy = trainer.strategy
        seen.append((trainer.max_steps, strategy.parallel.tensor_model_parallel_size,
                     strategy.parallel.pipeline_model_parallel_size))
        raise Launched

    monkeypatch.setattr(L.Trainer, "fit", fit)
    examples = spans("Any option can be overridden", "shows them all")
    assert len(examples) == 3 and examples[-1] == "--print_config", examples
    for example in examples[:2]:
        with pytest.raises(Launched):
            main(["fit", "--config", QUICKSTART, *shlex.split(example)])
    assert seen == [(10, 2, 1), (80, 1, 2)], seen


def test_readme_mistyped_options_are_refused(capsys):
    examples = spans("Options are never abbreviated", "ends in one")
    assert len(examples) == 2, examples
    for example in examples:
        line = refused(capsys, "fit", "--config", QUICKSTART, example, "1")
        assert example in line and "did you mean" in line, line


def test_the_program_freezes_what_its_imports_made(monkeypatch):
    """`lightning-mcore` (pyproject's script, `python -m lightning_mcore.cli`) is `command`: it
    freezes the import-time objects out of the garbage collector, then runs `main`, which a
    caller's own process runs without freezing anything."""
    import gc
    import importlib
    import tomllib

    from lightning_mcore import cli

    module, name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][
        "lightning-mcore"].split(":")
    assert getattr(importlib.import_module(module), name) is cli.command
    ran = []
    monkeypatch.setattr(cli, "main", lambda: ran.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        cli.command()
        assert ran and ran[0] > 10_000  # torch's, Lightning's and mcore's objects at least
    finally:
        gc.unfreeze()
