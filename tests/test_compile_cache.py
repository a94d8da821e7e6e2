"""The persistent compilation cache: on by default, in the place the environment says, off on request;
a second process loads the programs the first compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "checkpoints" / "tiny-nemotron-h"

# Generates from the tiny checkpoint and prints how many compilations went to the persistent cache and
# how many it served.
PROGRAM = f"""
import json, jax
hits, requests = [], []
jax.monitoring.register_event_listener(lambda e, **k: hits.append(e) if e.endswith("cache_hits") else None)
jax.monitoring.register_event_listener(lambda e, **k: requests.append(e) if e.endswith("requests_use_cache") else None)
import nemoh, sys
if sys.argv[1] == "generate":
    nemoh.generate(nemoh.load({str(TINY)!r}), [[1, 2, 3]], max_new_tokens=3)
print(json.dumps({{"dir": jax.config.jax_compilation_cache_dir,
                   "enabled": jax.config.jax_enable_compilation_cache, "hits": len(hits),
                   "requests": len(requests)}}))
"""


def _run(env_value: str | None, *argv: str, program: str = PROGRAM) -> dict:
    """Run `program` in a fresh interpreter with NEMOH_COMPILATION_CACHE=env_value (None: unset); its last
    line of output, parsed."""
    env = {k: v for k, v in os.environ.items() if k != "NEMOH_COMPILATION_CACHE"}
    if env_value is not None:
        env["NEMOH_COMPILATION_CACHE"] = env_value
    out = subprocess.run([sys.executable, "-c", program, *argv], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_cache(tmp_path):
    first = _run(str(tmp_path / "cache"), "generate")
    assert first["enabled"] and first["dir"] == str(tmp_path / "cache") and first["hits"] == 0
    assert any((tmp_path / "cache").iterdir())  # programs were written
    second = _run(str(tmp_path / "cache"), "generate")
    # every program came from disk: prefill and decode, and the loader's small conversions too
    assert second["hits"] >= 2 and second["hits"] == second["requests"], second


def test_cache_can_be_turned_off(tmp_path):
    off = _run("off", "import")
    assert not off["enabled"] and off["hits"] == 0


# In one process: generate with the cache in argv[1], then with it off, then in argv[2]; each time after
# jax.clear_caches(), so every program compiles again. Prints the cache requests of each phase.
SWITCHING = f"""
import json, sys, jax
from pathlib import Path
requests = []
jax.monitoring.register_event_listener(lambda e, **k: requests.append(e) if e.endswith("requests_use_cache") else None)
import nemoh
params = nemoh.load({str(TINY)!r})
counts = []
for where in (sys.argv[1], None, sys.argv[2]):
    nemoh.set_compilation_cache(where)
    jax.clear_caches()
    before = len(requests)
    nemoh.generate(params, [[1, 2, 3]], max_new_tokens=3)
    counts.append(len(requests) - before)
print(json.dumps({{"requests": counts, "second_dir_files": len(list(Path(sys.argv[2]).iterdir()))}}))
"""


def test_switching_the_cache_in_a_running_process(tmp_path):
    r = _run("off", str(tmp_path / "a"), str(tmp_path / "b"), program=SWITCHING)
    on_a, off, on_b = r["requests"]
    assert on_a >= 2 and off == 0 and on_b >= 2, r  # turned off, no program goes near the cache
    assert r["second_dir_files"] > 0  # and the new location is the one written


def test_default_location_is_the_user_cache_dir(monkeypatch, tmp_path):
    from nemoh.compile_cache import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "nemoh" / "jax-compilation"
