"""jsonargparse's parse errors as one line that names the key at fault and the closest valid ones.

jsonargparse reports a typo in a nested key (`--model.init_args.optim.lrr`) as some 60 lines of
usage and union subtypes with the useful line buried; `MegatronCLI.parse_arguments` prints
`error: <this line>` instead. A message this module does not recognise is kept whole.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from typing import Iterable, Optional

SUBCOMMANDS = ("fit", "validate", "test", "predict", "export", "verify", "preprocess")
OPTIMIZER_HINT = ("the optimizer and its schedule are set with --model.init_args.optim.* "
                  "(lightning_mcore.OptimizerSettings: lr, min_lr, warmup_steps, weight_decay, ...)")


def one_line(message: str, argv: Iterable[str], options: Iterable[str]) -> str:
    """The line to print for jsonargparse's `message`; `argv`: the command line, `options`: the
    option strings the subcommand's parser accepts."""
    argv, options = [str(a) for a in argv], sorted(options)
    if "argument subcommand: invalid choice" in message or "to be one of {" in message:
        given = next((a for a in argv if not a.startswith("-")), None)
        unknown = given and "invalid choice" in message
        said = f"unknown subcommand '{given}'" if unknown else "no subcommand given"
        return f"{said}: the subcommands are {', '.join(SUBCOMMANDS)}{_did_you_mean(given, SUBCOMMANDS)}"
    unrecognized = re.search(r"Unrecognized arguments: (.*)", message, re.I)
    if unrecognized:
        flags = [a.split("=", 1)[0] for a in unrecognized.group(1).split() if a.startswith("--")]
        return "; ".join(_unknown_flag(flag, options) for flag in flags) if flags else message.strip()
    nested = _nested_option(message)
    if nested is not None:
        name, class_path = nested
        flags = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
        typed = next((flag for flag in flags if flag.endswith(f".{name}")), None)
        where = f" (given as {typed})" if typed else ""
        return (f"{class_path} has no option '{name}'{where}"
                f"{_did_you_mean(name, _parameters(class_path))}")
    return message.strip()


def _unknown_flag(flag: str, options: list[str]) -> str:
    if flag in ("--optimizer", "--lr_scheduler") or flag.startswith(("--optimizer.", "--lr_scheduler.")):
        return f"unknown option {flag}: {OPTIMIZER_HINT}"
    return f"unknown option {flag} (options are not abbreviated){_did_you_mean(flag, options)}"


def _nested_option(message: str) -> Optional[tuple[str, str]]:
    """(option, class path) of the innermost "Option 'x' is not accepted" and the class_path it
    was given for."""
    found, class_path = None, None
    for line in message.splitlines():
        path = re.search(r"Problem with given class_path '([\w.]+)'", line)
        if path:
            class_path = path.group(1)
        option = re.search(r"(?:Option|Key) '([\w.]+)' is not (?:accepted|expected)", line)
        if option and class_path:
            found = (option.group(1), class_path)
    return found


def _parameters(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        return list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
    except (ImportError, AttributeError, ValueError, TypeError):
        return []


def _did_you_mean(given: Optional[str], choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(given or "", list(choices), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""
