"""JAX's persistent compilation cache, on by default for nemoh's programs.

A second process (a restarted notebook, the CLI) then loads compiled decode and prefill programs from
disk instead of compiling them again, and the small programs of loading a checkpoint too (JAX's default
skips programs that compile in under a second; a load runs dozens of them, each a fresh ptxas run on a
GPU). Location: $NEMOH_COMPILATION_CACHE if set to a path, else
$XDG_CACHE_HOME/nemoh/jax-compilation (~/.cache/... without XDG_CACHE_HOME). NEMOH_COMPILATION_CACHE=0
(or "off") turns it off; a cache directory the user already gave JAX is left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV_VAR = "NEMOH_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nemoh" / "jax-compilation"


def set_compilation_cache(path: str | Path | None) -> Path | None:
    """Use `path` as JAX's persistent compilation cache (None turns it off). Returns the path in use.
    Takes effect for the next compile also in a process that has compiled already (JAX decides once per
    process whether to use its cache and where it is, so that decision is reset here)."""
    compilation_cache.reset_cache()
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def enable_default_cache() -> Path | None:
    """What `import nemoh` does: the environment's choice, else the default location, unless JAX was
    already given a cache directory. An unwritable location leaves the cache off rather than failing."""
    setting = os.environ.get(ENV_VAR, "")
    if setting.lower() in _OFF:
        return set_compilation_cache(None)
    if jax.config.jax_compilation_cache_dir is not None:
        return Path(jax.config.jax_compilation_cache_dir)
    try:
        return set_compilation_cache(setting or default_cache_dir())
    except OSError:
        return None
