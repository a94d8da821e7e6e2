"""compiles(): the names of the programs XLA compiles inside a block, from jax.monitoring's compile
events (a persistent-cache hit is not a compile)."""

from __future__ import annotations

import contextlib

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compiles():
    """Yields the list of names ("jit(_decode)", ...) of the programs compiled inside the block."""
    names: list[str] = []

    def listen(event: str, seconds: float, **kw):
        if event == COMPILE_EVENT:
            names.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
