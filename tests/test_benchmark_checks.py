"""benchmarks/checks.py's per-layer check (every layer kind and the lm_head, for a dense and an NVFP4 model:
tiny, on the CPU, where both sides run the reference, so the errors are bf16 against fp32 rounding; its
fp32 reference moving to the host when the device is full), its margin check's perturbation, the HBM
ceiling and tiling parser of benchmarks/common.py, the sampler benchmark's check, the SSD benchmark's
comparison of trees, the hardware-counter target's case, and decode.py's count of the experts a batch
step reads (benchmarks/routing.py)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import benchmarks.checks as checks
from benchmarks.common import hbm_ceiling_gbs, parse_sampling, parse_tilings, parse_xla_options
from nemoh.config import NemotronHConfig
from nemoh.engine.sampling import Sampling
from nemoh.random_params import random_params
from oracle_configs import QUANTISABLE_WIDTHS
from pallas_kernels import linear
from pallas_kernels._blocked import Tiling

CONFIG = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "ME*M-", "intermediate_size": 32})


@pytest.mark.parametrize("layout", ["dense", "NANO_NVFP4"])
def test_layer_check_covers_every_kind_and_the_head(layout):
    errs, line = checks.layer_check_line(random_params(CONFIG, layout), context=8, prefill_tokens=40)
    kinds = {"mamba", "attention", "moe", "mlp"}
    assert set(errs) == kinds | {"lm_head"} | {f"{k} prefill" for k in kinds}
    assert "; 40-token block mamba" in line
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


def _device_full(monkeypatch, message):
    """jax.jit as on a device without room: a program compiled with the references' options raises."""
    real = jax.jit

    def jit(fn, **kwargs):
        if kwargs.get("compiler_options") is checks.REFERENCE_XLA:
            def full(*args):
                raise jax.errors.JaxRuntimeError(message)
            return full
        return real(fn, **kwargs)
    monkeypatch.setattr(jax, "jit", jit)


def test_fp32_reference_moves_to_the_host_when_the_device_is_full(monkeypatch):
    _device_full(monkeypatch, "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.34GiB")
    out = checks._fp32_reference(lambda a, b: a * b, jnp.arange(3.0), jnp.float32(2))
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])


def test_fp32_reference_raises_other_device_errors(monkeypatch):
    _device_full(monkeypatch, "INTERNAL: a kernel failed")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        checks._fp32_reference(lambda a: a, jnp.arange(3.0))


@pytest.mark.parametrize("layout", ["NANO_FP8", "NANO_NVFP4"])
def test_margin_perturbation_scales_outputs_and_keeps_activation_quantisation(layout):
    """The margin check's x1.001 model differs from the model only by that factor: a projection that
    quantises its input (a calibrated W8A8 / W4A4 checkpoint's) still does."""
    params = random_params(CONFIG, layout, dtype=jnp.float32)
    moe = params.layers[1]
    up = moe.experts_up
    per_tensor = up.scale if layout == "NANO_FP8" else up.global_scale
    up = dataclasses.replace(up, input_scale=jnp.full(per_tensor.shape, 0.01, jnp.float32))
    params = dataclasses.replace(params, layers=(params.layers[0], dataclasses.replace(moe, experts_up=up),
                                                 *params.layers[2:]))
    perturbed_up = checks.perturbed(params).layers[1].experts_up
    assert perturbed_up.input_scale is not None
    x = jax.random.normal(jax.random.key(0), (3, up.shape[-1]), jnp.float32)
    first = lambda w: jax.tree.map(lambda t: t[0], w)  # expert 0
    np.testing.assert_allclose(linear(x, first(perturbed_up), impl="xla"), 1.001 * linear(x, first(up), impl="xla"),
                               rtol=1e-5, atol=1e-6)


def test_hbm_ceiling_is_the_faster_of_a_read_and_an_in_place_scale(monkeypatch):
    """bytes moved over each pass's median time (a read moves the array once, an in-place scale twice),
    with the passes' times given: 2 ms for the read, 3 ms for the scale."""
    from benchmarks import common

    elements = 1 << 16
    assert 0 < hbm_ceiling_gbs(elements) < float("inf")  # measured on this machine
    passes = iter([[2e-3] * 10, [3e-3] * 10])
    monkeypatch.setattr(common, "wall_s", lambda fn, reps: (fn(), next(passes))[1])
    assert common.hbm_ceiling_gbs(elements) == pytest.approx(2 * elements * 2 / 3e-3 / 1e9)


def test_decode_leg_reports_its_figures_and_splits_call_time():
    """benchmarks/decode.py's timing of one batch on a tiny model (CPU figures: only their presence and
    consistency are checked), with the call-overhead fit."""
    from benchmarks.decode import time_batch

    r = time_batch(random_params(CONFIG, "NANO_NVFP4"), 2, prompt=5, steps=2, repeats=2, ceiling=1.0, profile=False,
                   overhead=True, routing_steps=2)
    assert r["steps_timed"] == 4 and r["tok_per_s"] > 0 and r["ms_per_token"] == r["ms_per_step"] / 2
    assert len(r["ms_per_step_by_call"]) == 2 and np.isclose(np.median(r["ms_per_step_by_call"]), r["ms_per_step"])
    assert r["decode_compile_s"] > 0 and r["prefill_compile_s"] > 0 and r["weight_bytes_per_token"] > 0
    assert r["call_overhead"]["ms_per_step"] > 0 and set(r["call_overhead"]) == {"fixed_ms_per_call", "ms_per_step"}
    routing = r["routing"]  # 2 tokens of top-2 over 4 experts, 2 probed steps of one MoE layer
    assert routing["tokens"] == 2 and routing["layer_steps"] == 2 and 2 <= routing["min"] <= routing["max"] <= 4
    assert routing["uniform"] == 4 * (1 - 0.5**2)
    routed_weights, uniform_weights = r["bytes_per_step_routed"]["weights"], r["bytes_per_step"]["weights"]
    assert (routed_weights - uniform_weights) * (routing["mean"] - routing["uniform"]) >= 0


def test_decode_leg_draws_with_the_sampling_it_is_given(monkeypatch):
    import benchmarks.decode as decode_benchmark

    seen = []

    def prefill(params, prompts, **kw):
        seen.append(kw["sampling"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(decode_benchmark, "prefill", prefill)
    with pytest.raises(RuntimeError, match="stop here"):
        decode_benchmark.time_batch(random_params(CONFIG, "dense"), 2, prompt=5, steps=2, repeats=1, ceiling=1.0,
                                    profile=False, sampling=parse_sampling("temperature=1.0"))
    assert seen == [Sampling(temperature=1.0)]


def test_prefill_leg_warms_up_then_times():
    from benchmarks import prefill as prefill_benchmark

    calls = []
    real_warm_up = prefill_benchmark.warm_up
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill_benchmark, "warm_up", lambda fn: calls.append(real_warm_up(fn, seconds=0.0, min_calls=2)))
        r = prefill_benchmark.time_shape(random_params(CONFIG, "NANO_NVFP4"), 2, 8, repeats=2, profile=False)
    assert calls == [2]
    assert r["prompt_tokens"] == 16 and r["tok_per_s"] > 0 and r["compile_s"] >= 0  # 0: compiled by another test
    assert 0 < r["host_ms_per_call"] < r["ms_per_call"]
    assert "ms/call (host checks and inputs" in prefill_benchmark.prefill_line("L", r, "ungated", "check")


def test_warm_up_runs_for_its_time_and_at_least_its_calls(monkeypatch):
    from benchmarks import common

    clock = [0.0]  # a call takes 0.25 s of a fake clock: no dependence on this machine's load

    def call():
        clock[0] += 0.25

    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert common.warm_up(call, seconds=1.0, min_calls=2) == 4 and clock[0] == 1.0  # its time
    assert common.warm_up(call, seconds=0.5, min_calls=3) == 3  # at least its calls
    assert common.warm_up(call, seconds=0.0, min_calls=1) == 1


def test_tiling_specs_parse_to_tilings_and_bad_names_are_refused():
    assert parse_tilings("tk=128,ctas_per_sm=8;stages=2,ptx=false") == [Tiling(tk=128, ctas_per_sm=8),
                                                                       Tiling(stages=2, ptx=False)]
    assert parse_tilings("") == []
    assert parse_xla_options("xla_a=FUSION,CONDITIONAL xla_b=false; xla_c=-3") == [
        {"xla_a": "FUSION,CONDITIONAL", "xla_b": False}, {"xla_c": -3}]
    assert parse_xla_options("") == []
    with pytest.raises(ValueError, match="want xla_"):
        parse_xla_options("cub=false")
    with pytest.raises(ValueError, match="tiles"):
        parse_tilings("tiles=4")
    with pytest.raises(ValueError, match="tk="):
        parse_tilings("tk=")


def test_ab_traces_each_variant_under_its_own_tiling():
    """benchmarks/ab.py's with_tiling: a program traced inside sees that tiling as every op's default,
    even when the same function was traced before under another (caches are cleared), and the default
    comes back afterwards, also when tracing fails."""
    from benchmarks.ab import with_tiling
    from pallas_kernels import _blocked

    seen = []
    traced = jax.jit(lambda x: seen.append(_blocked.DEFAULT_TILING) or x + 1)
    default = _blocked.DEFAULT_TILING
    for tiling in (Tiling(bf16_operands=False), Tiling(ctas_per_sm=8)):
        with_tiling(tiling, lambda: traced.lower(jnp.zeros(3)).compile())
    assert seen == [Tiling(bf16_operands=False), Tiling(ctas_per_sm=8)] and _blocked.DEFAULT_TILING is default
    with pytest.raises(ZeroDivisionError):
        with_tiling(Tiling(stages=2), lambda: 1 / 0)
    assert _blocked.DEFAULT_TILING is default


@dataclasses.dataclass(frozen=True)
class OtherTokens:
    """A compared program whose tokens differ from the default's: the default program, then every
    sampled token id plus one (what a variant that changed values would give)."""

    def compile(self, lower):
        from benchmarks.ab import Variant

        program = Variant().compile(lower)

        def run(*args):
            out = program(*args)
            return dataclasses.replace(out, tokens=out.tokens + 1, sequences=out.sequences + 1)
        return run


def test_ab_ratios_are_per_round_against_the_first_variant():
    from benchmarks.ab import ratios_to_first

    r = ratios_to_first({"a": [1.0, 2.0, 4.0], "b": [2.0, 3.0, 4.0]})
    assert r == {"a": [1.0, 1.0, 1.0], "b": [1.5, 1.0, 2.0]}


def test_ab_compares_variants_call_by_call():
    """benchmarks/ab.py on a tiny model (CPU figures: only their shape is checked): one median and one
    ratio to the default per variant, the same greedy tokens where the tiling changes no value, and
    other tokens reported as such."""
    from benchmarks.ab import Variant, compare_batch

    variants = {"default": Variant(), "two stages": Variant(Tiling(stages=2)),
                "no cub sort": Variant(xla=(("xla_gpu_enable_cub_radix_sort", False),)), "other": OtherTokens()}
    r = compare_batch(random_params(CONFIG, "NANO_NVFP4"), variants, batch=2, prompt=5, steps=2, rounds=2)
    b = r["variants"]["two stages"]
    assert len(b["ms_per_call_step"]) == 2 and b["ms_per_step"] > 0 and len(b["ratio_to_a"]) == 3
    assert {name: v["tokens_equal_a"] for name, v in r["variants"].items()} == {
        "default": True, "two stages": True, "no cub sort": True, "other": False}


def test_ab_compares_sampled_tokens():
    """With sampling settings every variant draws from the same seeds: programs that compute the same
    values draw the same tokens (the sampler's branch runs), and the settings are recorded."""
    from benchmarks.ab import Variant, compare_batch

    sampling = parse_sampling("temperature=0.8,top_k=20,top_p=0.9")
    assert sampling == Sampling(temperature=0.8, top_k=20, top_p=0.9) and parse_sampling("") == Sampling()
    with pytest.raises(ValueError, match="top_q"):
        parse_sampling("top_q=0.9")
    variants = {"default": Variant(), "no cub sort": Variant(xla=(("xla_gpu_enable_cub_radix_sort", False),))}
    r = compare_batch(random_params(CONFIG, "NANO_NVFP4"), variants, batch=2, prompt=5, steps=3, rounds=2,
                      sampling=sampling)
    assert r["sampling"]["top_k"] == 20 and all(v["tokens_equal_a"] for v in r["variants"].values())


def test_ab_compiles_a_variants_xla_options():
    """An XLA option set reaches the compile of its program: a misspelt option fails there."""
    from benchmarks.ab import Variant

    lowered = lambda: jax.jit(lambda x: x + 1).lower(jnp.zeros(3))
    assert Variant(xla=(("xla_gpu_enable_cub_radix_sort", False),)).compile(lowered)(jnp.zeros(3)).tolist() == [1] * 3
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        Variant(xla=(("xla_gpu_no_such_option", True),)).compile(lowered)


def test_ab_compares_prefill_programs():
    """benchmarks/ab.py's prefill comparison on a tiny model: a rate per variant from calls on fresh
    (donated) inputs, and the same first tokens."""
    from benchmarks.ab import Variant, compare_prefill

    variants = {"default": Variant(), "two stages": Variant(Tiling(stages=2)), "other": OtherTokens()}
    r = compare_prefill(random_params(CONFIG, "NANO_NVFP4"), variants, rows=2, tokens=9, rounds=2)
    assert all(v["tok_per_s"] > 0 and len(v["ratio_to_a"]) == 3 for v in r["variants"].values())
    assert {name: v["tokens_equal_a"] for name, v in r["variants"].items()} == {
        "default": True, "two stages": True, "other": False}


def test_gate_asks_the_oracle_once_per_checkpoint(monkeypatch):
    """Gating several kernel variants of one layout in one process (benchmarks/ab.py) runs transformers
    once: the reference tokens of a checkpoint and prompts are kept."""
    calls = []
    monkeypatch.setattr(checks.oracle, "greedy", lambda jobs: calls.append(jobs) or [[{"tokens": [7]}] * 2])
    checks.oracle_tokens.cache_clear()
    first = checks.oracle_tokens("/ckpt-a", ((1, 2), (3,)))
    assert checks.oracle_tokens("/ckpt-a", ((1, 2), (3,))) == first == [[7], [7]] and len(calls) == 1
    checks.oracle_tokens("/ckpt-b", ((1, 2), (3,)))
    assert len(calls) == 2 and calls[0][0]["prompts"] == [[1, 2], [3]]
    checks.oracle_tokens.cache_clear()


def test_sampler_benchmark_checks_its_cut_then_times(tmp_path, monkeypatch):
    """benchmarks/sampler.py checks the cut against the float64 rule before timing, and records both."""
    import json
    import sys

    import benchmarks.sampler as sampler

    monkeypatch.setattr(sys, "argv", ["sampler.py", "--batches", "1,9", "--vocab", "64", "--out", str(tmp_path)])
    monkeypatch.setattr(sampler, "loop_us", lambda fn, *args, iters=50: float(np.asarray(fn(*args, jnp.int32(1))).size))
    with pytest.raises(SystemExit) as done:
        sampler.main()
    records = [json.loads(line) for line in (tmp_path / "sampler.jsonl").read_text().splitlines()]
    assert done.value.code == 0
    assert [r["cut_rows_agreeing"] + r["rows_at_boundary"] for r in records] == [1, 9]
    assert set(records[1]["us"]) == {f"sample {name}" for name in sampler.SETTINGS} | {"cut alone", "sorted cut alone"}


def test_counter_target_runs_its_case_under_the_given_tiling(monkeypatch, capsys):
    """benchmarks/counters.py (a profiler's target) calls its op CALLS times under the tiling it is given;
    here the reference op, as a CPU has no Mosaic GPU kernel."""
    import sys

    import benchmarks.counters as counters

    monkeypatch.setattr(sys, "argv", ["counters.py", "gemv", "nvfp4", "--tiling", "stages=6", "--impl", "xla"])
    counters.main()
    assert capsys.readouterr().out.startswith(f"gemv nvfp4 {Tiling(stages=6)}: {counters.CALLS} calls")
    with pytest.raises(ValueError, match="bad tiling item"):
        monkeypatch.setattr(sys, "argv", ["counters.py", "gemv", "nvfp4", "--tiling", "stage=6"])
        counters.main()


def test_ssd_benchmark_compares_trees_against_the_recurrence():
    """benchmarks/ssd.py: this tree's scan and another tree's (here the same file, loaded as a module of
    its own) both checked against the per-token recurrence and timed in one process."""
    from pathlib import Path

    from benchmarks import ssd as ssd_bench

    cfg = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "M"})
    other = ssd_bench.load_ssd(str(Path(__file__).parents[1]))
    assert other is not ssd_bench.ssd
    rows = ssd_bench.compare({"this": ssd_bench.ssd, "other": other}, cfg, rows=2, tokens=20, rounds=2)
    assert [r["variant"] for r in rows] == ["this", "other"]
    for r in rows:
        assert r["err_y"] < 1e-5 and r["err_state"] < 1e-5 and r["median_wall_us"] > 0
        assert r["device_us"] is None  # CUPTI is GPU only
        assert ssd_bench.line(r).startswith(f"{r['variant']} 2x20: ")


def test_routing_probe_counts_the_experts_live_rows_select():
    """benchmarks/routing.py: rows of one prompt route alike (k experts a MoE layer and step), rows of
    different prompts to more; the probed steps produce the tokens plain decode does."""
    from benchmarks.routing import routed_experts
    from nemoh.engine.decode import decode
    from nemoh.engine.kv_pages import CacheSpec
    from nemoh.engine.prefill import prefill

    cfg = NemotronHConfig.from_dict({**QUANTISABLE_WIDTHS, "hybrid_override_pattern": "ME*E", "n_routed_experts": 16,
                                     "intermediate_size": 32})
    params = random_params(cfg, "dense")
    carry = lambda prompts: prefill(params, [np.asarray(p, np.int32) for p in prompts], max_new_tokens=8,
                                    sampling=Sampling(), stop_ids=(), seed=0, cache=CacheSpec())
    alike, _ = routed_experts(params, carry([[5, 6, 7, 8]] * 4), steps=3)
    assert alike == {"mean": 2.0, "min": 2, "max": 2, "tokens": 4, "layer_steps": 6}
    diverse, probed_carry = routed_experts(params, carry([[5, 6, 7, 8], [9, 3, 4], [11, 12], [20, 21, 22, 23, 24]]), 3)
    assert diverse["max"] > 2 and diverse["tokens"] == 4 and diverse["layer_steps"] == 6
    plain = decode(params, carry([[5, 6, 7, 8], [9, 3, 4], [11, 12], [20, 21, 22, 23, 24]]), 3)
    np.testing.assert_array_equal(np.asarray(probed_carry.sequences), np.asarray(plain.sequences))
