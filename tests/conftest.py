"""Shared pytest fixtures, and the 8-device mesh worker started beside the suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from oracle_configs import build_all

ROOT = Path(__file__).resolve().parents[1]
DEMO_CHECKPOINT = ROOT / "checkpoints" / "alice-nemotron-h"
MESH_TESTS = "test_mesh.py"
MESH_WORKER = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def start_mesh_worker() -> tuple[subprocess.Popen, Path]:
    """Start tests/mesh_worker.py (jax on 8 host devices, in its own process) writing into a new
    directory; its output goes to files there, so nothing blocks on a full pipe. No persistent
    compilation cache: the worker counts the programs it compiles."""
    out = Path(tempfile.mkdtemp(prefix="nemoh-mesh-"))
    env = {**os.environ, "NEMOH_COMPILATION_CACHE": "off"}
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "mesh_worker.py"), str(out)],
                                stdout=stdout, stderr=stderr, cwd=ROOT, env=env)
    return proc, out


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """When mesh tests are selected, their worker (minutes of compiling on one core) starts now and
    runs beside the rest of the suite, and the mesh tests go last."""
    mesh = [item for item in items if item.path.name == MESH_TESTS]
    if mesh:
        items[:] = [item for item in items if item.path.name != MESH_TESTS] + mesh
        config.stash[MESH_WORKER] = start_mesh_worker()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip counts as passing only for tests marked gpu_only (kernel paths the CPU interpreter cannot
    run); any other skip is reported as a failure, so a missing environment cannot pass unnoticed."""
    report = (yield).get_result()
    if report.skipped and not item.get_closest_marker("gpu_only") and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped outside the GPU-only tests: {report.longrepr}"


def pytest_unconfigure(config):
    started = config.stash.get(MESH_WORKER, None)
    if started is not None:
        proc, out = started
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of each tests/oracle_configs.CONFIGS checkpoint (float32, made by HF
    transformers once per session). Raises OracleUnavailable (an error, never a skip) when the
    oracle environment is missing."""
    return build_all(tmp_path_factory.mktemp("oracle_checkpoints"))


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """The shipped trained demo checkpoint (with tokenizer.json and a chat template)."""
    return DEMO_CHECKPOINT
