"""Reading a Hugging Face checkpoint's config.json, and the errors for checkpoints we refuse.

What a config means (and which architectures we map) is the family modules' business:
lightning_mcore/models/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint or config that we cannot load (faithfully)."""


class HFCheckpointNotFoundError(HFCheckpointError, FileNotFoundError):
    """The path is not a directory, or the directory has no config.json."""


def read_config_json(path: Union[str, os.PathLike]) -> dict:
    """`<path>/config.json` as a dict."""
    path = Path(path)
    if not path.is_dir():
        raise HFCheckpointNotFoundError(
            f"{path} is not a directory; expected a Hugging Face checkpoint directory "
            "(holding config.json and *.safetensors)."
        )
    file = path / "config.json"
    if not file.is_file():
        raise HFCheckpointNotFoundError(
            f"{path} has no config.json; expected a Hugging Face checkpoint directory "
            "(as written by save_pretrained)."
        )
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{file} is not valid JSON: {e}") from e
