#!/usr/bin/env bash
# Create .venv (Python 3.12) with nemoh installed editable plus its test and train extras (CI runs a few
# training steps of checkpoints/make_demo.py, which needs optax).
# Idempotent and fast when nothing changed: a stamp in .venv records the hash of pyproject.toml
# and the interpreter version it was installed for; pip runs only when that changes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# python3.12: pyenv's 3.12.1 when pyenv has it, else python3.12 on PATH.
. scripts/find_python.sh
find_python 3.12.1

STAMP=.venv/.nemoh-setup-stamp
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1) $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"

if ! .venv/bin/python -c '' >/dev/null 2>&1; then
    rm -rf .venv
    "$PYTHON" -m venv .venv
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    echo "setup.sh: .venv is up to date"
    exit 0
fi
.venv/bin/python -m pip install --quiet -e '.[test,train]'
echo "$WANT" > "$STAMP"
echo "setup.sh: .venv ready ($(.venv/bin/python --version))"
