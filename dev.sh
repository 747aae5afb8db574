#!/usr/bin/env bash
# flextensor's two commands, with their own set-up:
#   ./dev.sh demo   - 4 workers share one model through POSIX shared memory (the main job)
#   ./dev.sh test   - the test suite (what CI runs, through .ci/run)
# Set-up: a venv in .venv (FLEXTENSOR_VENV overrides), torch, then this project with its test extras.
# torch: an importable CUDA torch of the system Python is reused (the venv sees system site-packages);
# otherwise the CPU build torch==2.13.0 is installed. Re-installs only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
venv="${FLEXTENSOR_VENV:-.venv}"
python="${PYTHON:-python3}"

setup() {
    if [ ! -x "$venv/bin/python" ]; then
        if "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "dev.sh: CUDA torch found in $("$python" -c 'import sys; print(sys.executable)'); the venv reuses it" >&2
            "$python" -m venv --system-site-packages "$venv"
        else
            "$python" -m venv "$venv"
        fi
    fi
    local py="$venv/bin/python" stamp="$venv/.flextensor-installed"
    if ! "$py" -c 'import torch' 2>/dev/null; then
        "$py" -m pip install -q --disable-pip-version-check 'torch==2.13.0'
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        "$py" -m pip install -q --disable-pip-version-check -e '.[test]'
        touch "$stamp"
    fi
}

case "${1:-}" in
    demo) shift; setup; exec "$venv/bin/python" examples/demo.py "$@" ;;
    test) shift; setup; exec "$venv/bin/python" -m pytest -q tests "$@" ;;
    setup) setup ;;
    *) echo "usage: ./dev.sh demo|test|setup [args...]" >&2; exit 2 ;;
esac
