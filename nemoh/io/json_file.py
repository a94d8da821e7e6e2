"""read_json: the one reader of the JSON files nemoh takes in (config.json, hf_quant_config.json,
tokenizer_config.json, calibration amax, nemoh.save manifests)."""

from __future__ import annotations

import json
from pathlib import Path

from nemoh.errors import CheckpointError, NemohError


def read_json(path: str | Path, error: type[NemohError] = CheckpointError) -> dict:
    """The JSON object in `path`; `error` naming the file when it is missing, unreadable, not JSON or
    not an object."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: not a JSON object")
    return raw
