"""Per-layer-kind breakdown of a compiled program's GPU time, from a jax.profiler trace.

Every layer's ops carry a named scope (nemoh.model.layer_scope: mamba, attention, moe, mlp) and the
output projection carries "lm_head"; anything else in the decode step (embedding, sampling, carry
bookkeeping, the loop itself) is "glue". A fused XLA kernel is named after its HLO instruction, and the
compiled program's HLO text maps each instruction to its op_name, which holds the scope. The Mosaic GPU
kernels all share one name; the profiler reports each launch's CUDA grid, which is the kernel's grid
(N/64/tiles, B, splits) in reverse order (tiles: the 64-column weight tiles one CTA takes, 1 to
MAX_WEIGHT_TILES), and the HLO gives each Mosaic custom call's output f32[splits, B, tm, N] and scope, not
its tiles: a grid that one of its tile counts gives in one scope only takes that scope. Other kernels not named after an instruction
(cuBLAS, copies, Mosaic grids shared by several scopes) take the scope of the nearest attributed kernel
before them on the same stream (their own launch's operand prep). Kernel time is summed per scope; the
rest of the profiled wall time is launch gaps and host work.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time

import jax

SCOPES = ("mamba", "attention", "moe", "mlp", "lm_head")
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name="([^"]*)"')
_MOSAIC_OUT = re.compile(r'=\s*f32\[(\d+),(\d+),\d+,(\d+)\]\S*\s+custom-call\(.*custom_call_target="mosaic_gpu')
_GRID = re.compile(r"\bgrid:([\d,]+)")
TILE_N = 64  # output columns of one weight tile of a Mosaic kernel (pallas_kernels')
MAX_WEIGHT_TILES = 4  # tile counts a CTA may take that the grid match tries (Tiling.weight_tiles; up to 4 measured)


def _norm(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def _scope(op_name: str) -> str:
    return next((p for p in op_name.split("/") if p in SCOPES), "glue")


def op_scopes(hlo_text: str) -> dict[str, str]:
    """Normalised HLO instruction name -> scope, for every instruction with an op_name."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            out[_norm(m.group(1))] = _scope(m.group(2))
    return out


def mosaic_grid_scopes(hlo_text: str) -> dict[str, str]:
    """CUDA grid as the profiler prints it ("splits,B,N/64/tiles", rounded up) -> scope, for the grids
    that the Mosaic weight kernels' possible tile counts give in one scope only."""
    seen = collections.defaultdict(set)
    for line in hlo_text.splitlines():
        out, op = _MOSAIC_OUT.search(line), _INSTR.match(line)
        if out and op:
            splits, blocks, n = (int(g) for g in out.groups())
            for tiles in range(1, MAX_WEIGHT_TILES + 1):
                seen[f"{splits},{blocks},{-(-n // (TILE_N * tiles))}"].add(_scope(op.group(2)))
    return {grid: scopes.pop() for grid, scopes in seen.items() if len(scopes) == 1}


def attribute(events, hlo_text: str) -> tuple[list[str], int]:
    """The scope of each event (name, duration ns, start ns, CUDA grid or None, stream), in the order
    given, and how many were scoped by their neighbour."""
    by_name, by_grid = op_scopes(hlo_text), mosaic_grid_scopes(hlo_text)
    scopes = [None] * len(events)
    last_scope: dict[str, str] = {}
    by_neighbour = 0
    for i in sorted(range(len(events)), key=lambda i: events[i][2]):
        name, _, _, grid, stream = events[i]
        scope = by_name.get(_norm(name)) or by_grid.get(grid)
        if scope is None:
            by_neighbour += 1
            scope = last_scope.get(stream, "glue")
        else:
            last_scope[stream] = scope
        scopes[i] = scope
    return scopes, by_neighbour


def _trace_events(xspace_path: str) -> tuple[list, list]:
    """(GPU kernel events (name, duration ns, start ns, CUDA grid or None, stream), host events (name,
    duration ns, start ns, thread): Python calls and the XLA runtime's annotations) of a trace, each in
    start order, on one clock."""
    from jax.profiler import ProfileData

    kernels, host = [], []
    for plane in ProfileData.from_file(xspace_path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue
                for ev in line.events:
                    grid = _GRID.search(str(dict(ev.stats).get("kernel_details", "")))
                    kernels.append((ev.name, float(ev.duration_ns), float(ev.start_ns), grid and grid.group(1),
                                    line.name))
        elif plane.name == "/host:CPU":
            for line in plane.lines:
                host += [(ev.name, float(ev.duration_ns), float(ev.start_ns), line.name)
                         for ev in line.events if ev.duration_ns > 0]
    return sorted(kernels, key=lambda e: e[2]), sorted(host, key=lambda e: e[2])


def traced_events(run) -> tuple[list, list, float]:
    """Profile `run()` (which must block until its device work is done): (its GPU kernel events, host
    events (_trace_events), wall seconds of the call)."""
    with tempfile.TemporaryDirectory(prefix="nemoh-profile-") as tmp:
        with jax.profiler.trace(tmp):
            t0 = time.perf_counter()
            run()
            wall = time.perf_counter() - t0
        paths = sorted(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True))
        return (*_trace_events(paths[-1]), wall) if paths else ([], [], wall)


def profile_breakdown(run, hlo_text: str, steps: int) -> dict:
    """Profile `run()` (which must block until done and run `steps` decode steps) and split its GPU
    kernel time by scope. Returns per-scope kernel µs and launches per step, the top kernels, and the
    profiled wall time per step."""
    events, _, wall = traced_events(run)
    per_scope_us = collections.Counter()
    per_scope_n = collections.Counter()
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    scopes, unmapped = attribute(events, hlo_text)
    for (name, dur, _, grid, _), scope in zip(events, scopes):
        per_scope_us[scope] += dur / 1e3
        per_scope_n[scope] += 1
        k = per_kernel[(scope, f"{name[:90]} grid {grid}" if grid and "mosaic" in name else name[:90])]
        k[0] += dur / 1e3
        k[1] += 1
    span_us = 0.0
    if events:
        starts = [e[2] for e in events]
        ends = [e[2] + e[1] for e in events]
        span_us = (max(ends) - min(starts)) / 1e3
    total_us = sum(per_scope_us.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    gaps = idle_gaps(events, steps)
    return {
        "steps": steps,
        "kernels": len(events),
        "kernels_per_step": len(events) / steps,
        "kernels_scoped_by_neighbour": unmapped,
        "kernel_us_per_step": total_us / steps,
        "gpu_span_us_per_step": span_us / steps,
        "profiled_wall_us_per_step": wall * 1e6 / steps,
        "by_scope": {s: {"kernel_us_per_step": per_scope_us[s] / steps, "launches_per_step": per_scope_n[s] / steps}
                     for s in sorted(per_scope_us, key=lambda s: -per_scope_us[s])},
        "top_kernels": [{"scope": s, "kernel": n, "us_per_step": v[0] / steps, "launches_per_step": v[1] / steps}
                        for (s, n), v in top],
        "lines_seen": sorted({e[4] for e in events})[:10],
        "idle": gaps,
    }


def idle_gaps(events: list, steps: int, top: int = 12) -> dict:
    """Where a stream sat idle between consecutive kernels, per step: total µs in gaps by size
    (under 5 µs: back-to-back launches; 5-50 µs: the host launching op by op; over 50 µs: a stall),
    and the kernels that most often had to wait (gap before them, µs per step)."""
    by_stream = collections.defaultdict(list)
    for name, dur, start, _, stream in events:
        by_stream[stream].append((start, start + dur, name))
    bands = {"under_5us": [0.0, 0], "5_to_50us": [0.0, 0], "over_50us": [0.0, 0]}
    waited = collections.Counter()
    for evs in by_stream.values():
        evs.sort()
        for (_, end, _), (start, _, name) in zip(evs, evs[1:]):
            gap = (start - end) / 1e3
            if gap <= 0:
                continue
            band = bands["under_5us" if gap < 5 else "5_to_50us" if gap < 50 else "over_50us"]
            band[0] += gap
            band[1] += 1
            waited[name[:90]] += gap
    return {
        "us_per_step": {k: v[0] / steps for k, v in bands.items()},
        "gaps_per_step": {k: v[1] / steps for k, v in bands.items()},
        "waited_before": [{"kernel": n, "us_per_step": us / steps} for n, us in waited.most_common(top)],
    }


def breakdown_table(b: dict, step_ms: float, layer_counts: dict[str, int]) -> str:
    """Markdown rows: scope | layers | kernel µs per step | per layer | launches per step | share."""
    rows = ["| kind | layers | kernel µs / step | µs / layer | launches / step | share of kernel time |",
            "| --- | --- | --- | --- | --- | --- |"]
    total = b["kernel_us_per_step"] or 1.0
    for scope, v in b["by_scope"].items():
        n = layer_counts.get(scope, 0)
        per_layer = f"{v['kernel_us_per_step'] / n:.1f}" if n else "-"
        rows.append(f"| {scope} | {n or '-'} | {v['kernel_us_per_step']:.0f} | {per_layer} | "
                    f"{v['launches_per_step']:.0f} | {100 * v['kernel_us_per_step'] / total:.0f}% |")
    gaps = b["profiled_wall_us_per_step"] - b["kernel_us_per_step"]
    rows.append(f"| (sum of kernels) | | {b['kernel_us_per_step']:.0f} | | {b['kernels_per_step']:.0f} | |")
    rows.append(f"| (profiled wall - kernels: gaps, op-by-op) | | {gaps:.0f} | | | |")
    idle = b["idle"]["us_per_step"]
    rows.append(f"| (idle between kernels: under 5 µs / 5-50 µs / over 50 µs gaps) | | {idle['under_5us']:.0f} / "
                f"{idle['5_to_50us']:.0f} / {idle['over_50us']:.0f} | | | |")
    rows.append(f"| (unprofiled step, for comparison) | | {1e3 * step_ms:.0f} | | | |")
    return "\n".join(rows)
