"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from oracle_configs import build_all

ROOT = Path(__file__).resolve().parents[1]
DEMO_CHECKPOINT = ROOT / "checkpoints" / "alice-nemotron-h"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of each tests/oracle_configs.CONFIGS checkpoint (float32, made by HF
    transformers once per session). Raises OracleUnavailable (an error, never a skip) when the
    oracle environment is missing."""
    return build_all(tmp_path_factory.mktemp("oracle_checkpoints"))


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """The shipped trained demo checkpoint (with tokenizer.json and a chat template)."""
    return DEMO_CHECKPOINT
