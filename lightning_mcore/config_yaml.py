"""The CLI's YAML loader: jsonargparse's own, after refusing a key given twice in one mapping.

YAML keeps the last of two equal keys without a word, so a config with `max_steps: 3` and,
further down, `max_steps: 7` trains 7 steps. The CLI's parsers load with this mode instead
(MegatronCLI.init_parser); jsonargparse reports the error with the config it was loading.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import yaml
from jsonargparse import get_loader, set_loader

MODE = "yaml_unique_keys"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document names one key twice."""


def load(value: str, path: str = "") -> Any:
    """jsonargparse's "yaml" loader on `value` (the text of the config file `path`, or a value
    from the command line), refusing a duplicate key. jsonargparse gives the file's base name
    and parses in its directory."""
    refuse_duplicate_keys(value, os.path.abspath(path) if path else "")
    return get_loader("yaml")(value)


def refuse_duplicate_keys(text: str, path: str = "") -> None:
    """Raise DuplicateKeyError naming the file, the key and both lines of the first key that a
    mapping of `text` holds twice."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return  # not ours to report: the loader itself says what is wrong
    for key, first, second in _duplicates(root, "", set()):
        where = f"{path}" if path else "a value given on the command line"
        raise DuplicateKeyError(
            f"{where}: key '{key}' is given twice (line {first} and line {second}); YAML would "
            f"silently keep the second. Remove one of them."
        )


def _duplicates(node: yaml.Node, prefix: str, seen: set) -> Iterator[tuple[str, int, int]]:
    """(dotted key, first line, second line) of each key given twice, outermost first."""
    if id(node) in seen:  # an alias of a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple, int] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                name = f"{prefix}{key.value}"
                if (key.tag, key.value) in lines:
                    yield name, lines[(key.tag, key.value)], key.start_mark.line + 1
                lines.setdefault((key.tag, key.value), key.start_mark.line + 1)
                yield from _duplicates(value, f"{name}.", seen)
            else:
                yield from _duplicates(value, prefix, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _duplicates(item, f"{prefix}{index}.", seen)


set_loader(MODE, load, exceptions=(yaml.YAMLError,))
