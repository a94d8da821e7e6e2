"""compiles(): the names of the programs XLA compiles inside a block, from jax.monitoring's compile
events (a persistent-cache hit is not a compile), or of those lowered (LOWER_EVENT: every new program,
whether or not the persistent cache then serves it)."""

from __future__ import annotations

import contextlib
import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class CompiledNames(list):
    """Names of the programs compiled, in order; .threads: the thread that compiled each."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []


@contextlib.contextmanager
def compiles(which: str = COMPILE_EVENT):
    """Yields the CompiledNames ("jit(_decode)", ...) of the programs compiled (or with LOWER_EVENT,
    lowered) inside the block."""
    names = CompiledNames()

    def listen(event: str, seconds: float, **kw):
        if event == which:
            names.append(kw.get("fun_name", "?"))
            names.threads.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
