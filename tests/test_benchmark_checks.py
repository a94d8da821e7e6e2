"""benchmarks/checks.py's per-layer check: every layer kind and the lm_head, for a dense and an NVFP4 model
(tiny, on the CPU, where both sides run the reference: the errors are bf16 against fp32 rounding)."""

from __future__ import annotations

import pytest

import benchmarks.checks as checks
from nemoh.config import NemotronHConfig
from nemoh.random_params import random_params
from oracle_configs import QUANTISABLE_WIDTHS

CONFIG = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "ME*M-", "intermediate_size": 32})


@pytest.mark.parametrize("layout", ["dense", "NANO_NVFP4"])
def test_layer_check_covers_every_kind_and_the_head(layout):
    errs, line = checks.layer_check_line(random_params(CONFIG, layout), context=8)
    assert set(errs) == {"mamba", "attention", "moe", "mlp", "lm_head"}
    assert all(0 < e < checks.LAYER_CHECK_MAX_ERR for e in errs.values()), line
    assert line.endswith(" PASS")


def test_lm_head_check_widens_only_the_head(monkeypatch):
    """The fp32 reference of the head gets params without layers: widening a whole bf16 Nano (60 GB) to
    fp32 does not fit beside it on one GPU."""
    seen = []
    real = checks.logits_from_hidden
    monkeypatch.setattr(checks, "logits_from_hidden", lambda p, h: seen.append(len(p.layers)) or real(p, h))
    checks.layer_check(random_params(CONFIG, "dense"), batch=2, context=8)
    assert seen == [0, 0]
