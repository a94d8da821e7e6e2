#!/usr/bin/env bash
# Run the test suite: make sure .venv and .venv-oracle exist and are current, then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k oracle -x`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash scripts/setup_oracle.sh
exec .venv/bin/python -m pytest -q tests "$@"
