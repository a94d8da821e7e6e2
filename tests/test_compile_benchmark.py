"""benchmarks/compile.py: the Mosaic kernel count of a program's HLO, one in-process measurement of
both programs' compile (a tiny model on the CPU: seconds, host events, a timed decode), the decode
program lowered for the GPU on the CPU, and the tiling the kernels take."""

from __future__ import annotations

import json

import jax

from benchmarks.compile import lowering, measure, mosaic_calls
from nemoh.compile_cache import set_compilation_cache
from oracle_configs import QUANTISABLE_WIDTHS

HLO = """
%a = f32[8] custom-call(%x), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/moe/1"}, backend_config="k1"
%b = f32[8] custom-call(%y), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/moe/2"}, backend_config="k1"
%c = f32[8] custom-call(%z), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/mamba"}, backend_config="k2"
%d = f32[8] custom-call(%z), custom_call_target="cublas$gemm", backend_config="k1"
"""


def test_mosaic_calls_counts_calls_and_distinct_kernels_apart_from_metadata():
    assert mosaic_calls(HLO) == (3, 2)
    assert mosaic_calls("") == (0, 0)


def test_measure_times_both_programs(tmp_path):
    dims = tmp_path / "dims.json"
    dims.write_text(json.dumps(QUANTISABLE_WIDTHS))
    cache = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    try:
        r = measure("NANO_NVFP4", batch=2, prompt=5, steps=2, pattern="ME*M", dims=str(dims))  # turns the cache off
    finally:
        set_compilation_cache(cache)
    for program in ("prefill", "decode"):
        assert r[program]["lower_s"] > 0 and r[program]["compile_s"] > 0
        assert r[program]["mosaic_calls"] == (0, 0)  # the CPU runs the "xla" reference ops
    events = {e["event"] for e in r["decode"]["host_events"]}
    assert "backend_compile_and_load" in events and not any(e.startswith("$") for e in events)
    assert r["decode_ms_per_step_ungated"] > 0


def test_lowering_lowers_both_programs_for_the_gpu(tmp_path):
    """On the CPU: the prefill and decode programs of a small NVFP4 model, with the Pallas kernels, lower
    for "cuda" (every kernel through Mosaic GPU's lowering), and the seconds are reported."""
    dims = tmp_path / "dims.json"
    dims.write_text(json.dumps(QUANTISABLE_WIDTHS))
    (r1, r4) = lowering("NANO_NVFP4", [1, 4], prompt=5, pattern="ME*M", dims=str(dims))
    assert [r1["batch"], r4["batch"]] == [1, 4]
    for r in (r1, r4):
        assert min(r["prefill_trace_s"], r["prefill_lower_s"], r["trace_s"], r["lower_s"]) > 0
        assert r["mosaic_kernels"] >= 4, r  # the MoE's two, Mamba's in/out projections at least


def test_tiling_option_applies_to_every_kernel(tmp_path, monkeypatch, capsys):
    """--tiling becomes the tiling every Pallas op takes (here the warpgroup-level lowering, whose lowering
    time is the comparison), and the report says so."""
    import sys

    from benchmarks.compile import main
    from pallas_kernels import _blocked

    dims = tmp_path / "dims.json"
    dims.write_text(json.dumps(QUANTISABLE_WIDTHS))
    monkeypatch.setattr(_blocked, "DEFAULT_TILING", _blocked.DEFAULT_TILING)  # restored afterwards
    monkeypatch.setattr(sys, "argv", ["compile.py", "--lower-only", "1", "--tiling", "lane_lowering=false",
                                      "--pattern", "ME*M", "--dims", str(dims), "--prompt", "5"])
    assert main() == 0
    assert _blocked.DEFAULT_TILING == _blocked.Tiling(lane_lowering=False)
    out = capsys.readouterr().out
    assert "NANO_NVFP4 batch 1, tiling lane_lowering=false: prefill of 5 tokens a prompt trace" in out
