"""GPU benchmarks (run from the repository root with PYTHONPATH=.); results go to docs/BENCHMARKS.md."""
