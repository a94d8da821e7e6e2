# Sourced by the setup scripts: find_python VERSION sets PYTHON to pyenv's VERSION when pyenv has it, else
# to python<major.minor> on PATH, and stops the calling script with a message naming what is missing.
find_python() {
    local version=$1 exe="python${1%.*}" caller
    caller=$(basename "$0")
    if command -v pyenv >/dev/null 2>&1 && pyenv prefix "$version" >/dev/null 2>&1; then
        PYTHON="$(pyenv prefix "$version")/bin/$exe"
    else
        PYTHON="$(command -v "$exe" || true)"
    fi
    if [ -z "$PYTHON" ] || [ ! -x "$PYTHON" ]; then
        echo "$caller: $exe not found (install it, or pyenv install $version)" >&2
        exit 1
    fi
}
