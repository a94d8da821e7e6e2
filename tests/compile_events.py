"""compiles(): the names of the programs XLA compiles inside a block, from jax.monitoring's compile
events (a persistent-cache hit is not a compile)."""

from __future__ import annotations

import contextlib
import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompiledNames(list):
    """Names of the programs compiled, in order; .threads: the thread that compiled each."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []


@contextlib.contextmanager
def compiles():
    """Yields the CompiledNames ("jit(_decode)", ...) of the programs compiled inside the block."""
    names = CompiledNames()

    def listen(event: str, seconds: float, **kw):
        if event == COMPILE_EVENT:
            names.append(kw.get("fun_name", "?"))
            names.threads.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
