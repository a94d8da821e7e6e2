"""The suite's one rule on skips (tests/conftest.py): only tests marked gpu_only may skip; any other skip
is a failure, so a missing environment or a forgotten skip cannot pass as green."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SKIPPING_TESTS = '''
import pytest

def test_plain_skip():
    pytest.skip("no environment")

@pytest.mark.gpu_only
def test_gpu_only_skip():
    pytest.skip("runs on the GPU only")

def test_passes():
    pass
'''


def test_only_gpu_only_tests_may_skip(tmp_path):
    (tmp_path / "test_skips.py").write_text(SKIPPING_TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "conftest", "-p", "no:cacheprovider",
                          "-W", "ignore::pytest.PytestUnknownMarkWarning", "test_skips.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": f"{TESTS}:{TESTS.parent}", "PATH": "/usr/bin:/bin"})
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "FAILED test_skips.py::test_plain_skip - skipped outside the GPU-only tests" in out, out
    assert "SKIPPED [1] test_skips.py:9: runs on the GPU only" in out, out
    assert "PASSED test_skips.py::test_passes" in out, out
    assert "1 failed, 1 passed, 1 skipped" in out, out
