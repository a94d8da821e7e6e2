"""GenerationClock: the wall time of one generate() call, with JAX compilation counted apart.

Compilation (tracing, lowering to MLIR, XLA compile) is measured through jax.monitoring's duration
events. Time until the first new token is the prefill phase; after it, the decode phase. The decode
program compiles on a worker thread beside prefill, so compile time is counted by program (decode's
own, whenever it ran; everything else by the phase it ended in), and steady-state decode speed
excludes only the compiling that overlapped the decode phase.
"""

from __future__ import annotations

import dataclasses
import time

import jax.monitoring

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})


@dataclasses.dataclass
class GenerationClock:
    """Use as `with GenerationClock() as clock:` around generate(on_token=clock.on_token)."""

    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    tokens: int = 0
    compile_prefill: float = 0.0
    compile_decode: float = 0.0
    compiling: list = dataclasses.field(default_factory=list)  # (start, end) of each compile event

    def _on_duration(self, event: str, duration_secs: float, fun_name: str = "", **_) -> None:
        if event in COMPILE_EVENTS:
            end = time.perf_counter()
            self.compiling.append((end - duration_secs, end))
            if self.first_token is None and "_decode" not in fun_name:
                self.compile_prefill += duration_secs
            else:
                self.compile_decode += duration_secs

    def _compiling_after(self, t: float) -> float:
        """Seconds after t (to the end) during which something was compiling (overlaps counted once)."""
        busy, reach = 0.0, t
        for start, end in sorted(self.compiling):
            start = max(start, reach)
            if end > start:
                busy += end - start
                reach = end
        return busy

    def __enter__(self) -> "GenerationClock":
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.end = time.perf_counter()
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

    def on_token(self, index: int, token: int) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.tokens += 1

    def report(self, batch: int) -> list[str]:
        """Lines: prefill (time to the first tokens, its compile share), decode (tokens, compile share,
        steady-state tokens/s), total. Prefill yields the first token of each of the `batch` prompts."""
        prefill = (self.first_token or self.end) - self.start
        decode = self.end - (self.first_token or self.end)
        decode_tokens = self.tokens - min(batch, self.tokens)
        steady = decode - self._compiling_after(self.first_token or self.end)
        lines = [f"prefill: first tokens after {prefill:.2f} s (compile {self.compile_prefill:.2f} s)"]
        if decode_tokens:
            rate = f"{decode_tokens / steady:.1f} tokens/s" if steady > 0 else "n/a"
            lines.append(f"decode: {decode_tokens} tokens in {decode:.2f} s (compile {self.compile_decode:.2f} s); "
                         f"steady state {rate}")
        total = self.end - self.start
        lines.append(f"total: {self.tokens} new tokens in {total:.2f} s, "
                     f"{self._compiling_after(self.start):.2f} s of it compiling")
        return lines
