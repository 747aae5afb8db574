#!/usr/bin/env bash
# Run the tests and/or benchmarks on a GPU host from a plain checkout, without installing flextensor:
# the three source folders are laid out as the package `flextensor` in a temporary site directory, and
# wheels found in .whl/ (posix_ipc, msgspec, pyzmq for hosts that cannot reach an index) go there too.
#   scripts/gpu-suite.sh tests [pytest args...]   the whole suite, CUDA tests included
#   scripts/gpu-suite.sh pytest ARGS...           pytest with exactly these arguments (chosen files)
#   scripts/gpu-suite.sh bench NAME [args...]     python bench/NAME.py args...
# Logs and JSON results go to $OUT (when set) or bench/results/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
site="$(mktemp -d)"
# Readable by every user: tests that run as other users (setpriv) import the package from here too.
chmod 755 "$site"
site="$site/site"
mkdir -p "$site"
cp -r client "$site/flextensor"
cp -r shm "$site/flextensor/shm"
cp -r daemon "$site/flextensor/daemon"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
fi
# Bytecode compiled ahead, as pip does at install: a first import then costs what it costs a user.
python3 -m compileall -q "$site" >/dev/null
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FLEXTENSOR_BENCH_OUT="${OUT:-$PWD/bench/results}"
export PYTHONUNBUFFERED=1
mkdir -p "$FLEXTENSOR_BENCH_OUT"
what="${1:-tests}"
shift || true
case "$what" in
    tests) python3 -m pytest -q -p no:cacheprovider tests "$@" ;;
    pytest) python3 -m pytest -p no:cacheprovider "$@" ;;
    bench) name="$1"; shift; python3 "bench/$name.py" "$@" ;;
    *) echo "usage: scripts/gpu-suite.sh tests|pytest|bench NAME [args...]" >&2; exit 2 ;;
esac
