"""benchmarks/profile.py: which layer kind each GPU kernel of a profiled step is counted under."""

from __future__ import annotations

from benchmarks.profile import attribute, mosaic_grid_scopes

# Lines in the form of a compiled decode program's HLO: fusions named after their instruction, and
# Mosaic weight kernels (output f32[splits, B, tm, N]); the o_proj and out_proj grids coincide.
HLO = """
  %loop_pad_fusion.8 = f16[1,8,4224]{2,1,0} fusion(%p), kind=kLoop, metadata={op_name="jit(_decode)/while/body/mamba/pad"}
  %mpmd_map.4 = f32[4,1,8,10304]{3,2,1,0} custom-call(%c, %loop_pad_fusion.8), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_decode)/while/body/mamba/jit(weight_gemm)/wgemm/mpmd_map"}
  %mpmd_map.6 = f32[13,1,8,2688]{3,2,1,0} custom-call(%c, %x), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_decode)/while/body/mamba/jit(weight_gemm)/wgemm/mpmd_map"}
  %mpmd_map.7 = f32[13,1,8,2688]{3,2,1,0} custom-call(%c, %y), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_decode)/while/body/attention/jit(weight_gemm)/wgemm/mpmd_map"}
  %input_reduce_fusion = f32[1]{0} fusion(%h), kind=kInput, metadata={op_name="jit(_decode)/while/body/reduce_sum"}
  %mpmd_map.25 = f32[1,1,8,131072]{3,2,1,0} custom-call(%c, %z), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_decode)/while/body/lm_head/jit(weight_gemm)/wgemm/mpmd_map"}
"""
MOSAIC = "wgemm_mosaic_gpu_kernel"


def test_mosaic_grids_map_to_their_scope_when_unambiguous():
    """Each kernel's grid under every tile count a CTA may take (the HLO does not say which): 131,072
    columns in 64-column tiles, three a CTA, make 683 CTAs; the o_proj and out_proj grids stay ambiguous."""
    grids = mosaic_grid_scopes(HLO)
    assert {g: grids[g] for g in ("4,1,161", "4,1,54", "1,1,2048", "1,1,683")} == {
        "4,1,161": "mamba", "4,1,54": "mamba", "1,1,2048": "lm_head", "1,1,683": "lm_head"}
    assert not any(g.startswith("13,1,") for g in grids)


def test_kernels_are_attributed_by_name_then_grid_then_neighbour():
    events = [  # (name, duration ns, start ns, CUDA grid, stream), deliberately out of time order
        (MOSAIC, 5.0, 2.0, "4,1,161", "s"),
        ("loop_pad_fusion_8", 1.0, 1.0, None, "s"),
        (MOSAIC, 5.0, 3.0, "13,1,42", "s"),   # shared grid: the scope of the kernel before it
        ("input_reduce_fusion", 1.0, 4.0, None, "s"),
        (MOSAIC, 9.0, 5.0, "1,1,683", "s"),  # the head (three tiles a CTA), after a glue kernel
        ("MemcpyD2D", 1.0, 6.0, None, "s"),
    ]
    scopes, by_neighbour = attribute(events, HLO)
    assert scopes == ["mamba", "mamba", "mamba", "glue", "lm_head", "lm_head"]
    assert by_neighbour == 2


def test_step_trace_names_what_each_fusion_holds():
    """benchmarks/step_trace.py: a compiled program's fusions map to the opcodes fused into them, and the
    launch table lists each kernel in order with its gap, scope and contents."""
    import jax
    import jax.numpy as jnp

    from benchmarks.step_trace import fused_ops, report

    hlo = jax.jit(lambda a: jnp.max(jnp.exp(a) * 2.0, axis=-1)).lower(jnp.ones((8, 128))).compile().as_text()
    ops = fused_ops(hlo)
    fusion = next(name for name, what in ops.items() if "exponential" in what and "multiply" in what)
    events = [(fusion, 1500.0, 0.0, None, "s"), (MOSAIC, 5000.0, 2000.0, "4,1,161", "s")]
    table = report(events, ["glue", "mamba"], hlo)
    assert table.startswith("2 launches, 6.5 µs of kernels, 7.0 µs first start to last end")
    assert f"| 0 | glue | {fusion} | 1.5 |  | {ops[fusion]} |" in table
    assert f"| 1 | mamba | {MOSAIC} | 5.0 | 0.5 | grid 4,1,161 |" in table


def test_step_trace_sums_idle_gaps_by_size_and_names_the_largest():
    """The trace's closing summary: idle time between launches under 5, 5-50 and over 50 µs, and the largest
    gaps with the launches either side (where a prefill call or a decode step waits)."""
    from benchmarks.step_trace import gap_summary

    us = 1e3  # events are in ns
    events = [("a", 1 * us, 0.0, None, "s"), ("MemcpyD2H", 1 * us, 3 * us, None, "s"),  # gap 2
              ("b", 1 * us, 84 * us, None, "s"),  # gap 80 after the copy
              ("c", 1 * us, 95 * us, None, "s"), ("d", 1 * us, 96 * us, None, "s")]  # gaps 10, 0
    lines = gap_summary(events, ["glue", "glue", "mamba", "mamba", "moe"])
    assert lines[1] == "idle between launches: under 5 µs 2.0 µs, 5-50 µs 10.0 µs (1 gaps), over 50 µs 80.0 µs (1 gaps)"
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert rows[0] == "| 80.0 | 1 (glue: MemcpyD2H) | 2 (mamba: b) |  |"
    assert rows[1] == "| 10.0 | 2 (mamba: b) | 3 (mamba: c) |  |"
    assert len(rows) == 4
    # with the call's host events: the innermost ones covering at least half of each gap
    host = [("prefill", 200 * us, -50 * us, "python"), ("execute", 70 * us, 10 * us, "xla"),
            ("launch", 30 * us, 40 * us, "xla"), ("read flags", 9 * us, 86 * us, "python")]
    rows = [line for line in gap_summary(events, ["glue"] * 5, host) if line.startswith("| 80.0")]
    assert rows == ["| 80.0 | 1 (glue: MemcpyD2H) | 2 (glue: b) | execute (xla) 70 µs; prefill (python) 200 µs |"]


def test_host_events_come_with_the_kernels_of_a_trace():
    """benchmarks/profile.py's traced_events: a profiled call's host events (the Python calls among them)
    beside its GPU kernels (none on the CPU)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.profile import traced_events

    def traced_probe(a):
        return jnp.sin(a) @ a

    f, x = jax.jit(traced_probe), jnp.ones((64, 64))
    f(x).block_until_ready()
    kernels, host, wall = traced_events(lambda: f(x).block_until_ready())
    assert kernels == [] and wall > 0
    assert any("traced_probe" in name for name, *_ in host)
    assert all(dur > 0 for _, dur, *_ in host) and [e[2] for e in host] == sorted(e[2] for e in host)
