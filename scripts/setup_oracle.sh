#!/usr/bin/env bash
# Create .venv-oracle (Python 3.11) with CPU torch 2.13.0, transformers 5.24.0, safetensors, numpy and
# jinja2 (transformers' apply_chat_template): the environment nemoh/oracle/hf_worker.py runs in.
# Idempotent: does nothing when the pinned versions are already installed.
#
# torch comes from a local CPU wheel when pip's configured find-links has one, else from PyTorch's
# CPU index ($NEMOH_TORCH_CPU_INDEX overrides it). Never from PyPI: PyPI's Linux torch is the CUDA
# build and pulls gigabytes of nvidia-* packages.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH=2.13.0
TRANSFORMERS=5.24.0
CPU_INDEX="${NEMOH_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
VENV=.venv-oracle

# The pinned versions are installed (package metadata only, so the up-to-date check is instant).
installed() {
    "$VENV/bin/python" - "$TORCH+cpu" "$TRANSFORMERS" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("torch") == sys.argv[1] and version("transformers") == sys.argv[2]
version("numpy"), version("safetensors"), version("jinja2")
PY
}

if [ -x "$VENV/bin/python" ] && installed; then
    echo "setup_oracle.sh: $VENV is up to date"
    exit 0
fi

# python3.11: pyenv's 3.11.7 when pyenv has it, else python3.11 on PATH.
. scripts/find_python.sh
find_python 3.11.7

if ! "$VENV/bin/python" -c '' >/dev/null 2>&1; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet)
if ! "${PIP[@]}" --no-index --no-deps "torch==$TORCH+cpu" >/dev/null 2>&1; then
    "${PIP[@]}" --no-deps --index-url "$CPU_INDEX" "torch==$TORCH+cpu"
fi
# torch is already satisfied, so this only adds its dependencies and the rest.
"${PIP[@]}" "torch==$TORCH" "transformers==$TRANSFORMERS" safetensors numpy "jinja2>=3.1.6"
if ! installed || ! "$VENV/bin/python" -c 'import torch, transformers.models.nemotron_h' >/dev/null; then
    echo "setup_oracle.sh: $VENV lacks a working CPU torch $TORCH + transformers $TRANSFORMERS" >&2
    exit 1
fi
echo "setup_oracle.sh: $VENV ready"
