#!/usr/bin/env bash
# Set up ringpipe in ./.venv (first time only) and run the main job or the test suite.
#   ./run.sh train [ringpipe train options]   # the default job: MLP on the embedded digits, 2 processes
#   ./run.sh test  [pytest options]           # the whole test suite
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY=python3
command -v "$PY" >/dev/null || PY=python

# Whether python can find every named module: located, not imported (importing TensorFlow, tf-keras,
# transformers and torch to see that they are there took ~25 s before every test run).
have() { "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' "$@"; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    # --system-site-packages: reuse a torch that is already installed instead of downloading it again.
    if ! "$PY" -m venv --system-site-packages "$VENV" 2>/dev/null; then
      echo "run.sh: python venv missing; installing python3-venv" >&2
      as_root apt-get update -qq && as_root apt-get install -y -qq python3-venv
      "$PY" -m venv --system-site-packages "$VENV"
    fi
  fi
  local vpy="$VENV/bin/python"
  # torch is pinned to the CPU build 2.13.0 when missing; an unpinned torch would pull CUDA wheels.
  # pip shows its progress bars here: downloading torch can take minutes on a first run.
  if ! have torch; then
    echo "run.sh: installing torch 2.13.0 (first run only; a large download)" >&2
    "$vpy" -m pip install --progress-bar on "torch==2.13.0"
  fi
  if ! have ringpipe pydantic tqdm matplotlib yaml; then
    echo "run.sh: installing ringpipe and its dependencies into $VENV (first run only)" >&2
    "$vpy" -m pip install --progress-bar on -e .
  fi
}

setup_tests() {
  # Open MPI from Debian's packages so the MPI tests run rather than skip.
  if ! command -v mpirun >/dev/null; then
    if command -v apt-get >/dev/null; then
      echo "run.sh: installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
      as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null \
        || echo "run.sh: could not install Open MPI; MPI tests will be skipped" >&2
    fi
  fi
  # iproute2 provides `ip netns` for the two-host tests.
  if ! command -v ip >/dev/null && command -v apt-get >/dev/null; then
    as_root apt-get install -y -qq iproute2 >/dev/null || true
  fi
  # OpenSSH (client and sshd) for the several-host launch tests, whose hosts run their own sshd.
  if { ! command -v ssh >/dev/null || { ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ]; }; } \
      && command -v apt-get >/dev/null; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-client openssh-server >/dev/null \
      || echo "run.sh: could not install OpenSSH; the several-host launch tests will be skipped" >&2
  fi
  local vpy="$VENV/bin/python"
  if ! have pytest pytest_timeout xdist hypothesis transformers; then
    echo "run.sh: installing the test tools (first run only)" >&2
    "$vpy" -m pip install --progress-bar on -e ".[dev]"
  fi
  if command -v mpirun >/dev/null && ! have mpi4py; then
    echo "run.sh: installing mpi4py (first run only; it compiles against Open MPI)" >&2
    "$vpy" -m pip install --progress-bar on -e ".[mpi]"
  fi
  # TensorFlow's CPU build, pinned (plain `tensorflow` pulls CUDA), so the TensorFlow tests run.
  if ! have tensorflow; then
    echo "run.sh: installing tensorflow-cpu==2.21.0 (first run only)" >&2
    "$vpy" -m pip install --progress-bar on "tensorflow-cpu==2.21.0"
  fi
  # tf-keras (Keras 2, for TF_USE_LEGACY_KERAS=1) without its dependencies: it requires the full
  # `tensorflow`, which pulls CUDA; tensorflow-cpu provides the same modules.
  if ! have tf_keras; then
    echo "run.sh: installing tf-keras==2.21.0 without dependencies (first run only)" >&2
    "$vpy" -m pip install --progress-bar on --no-deps "tf-keras==2.21.0"
  fi
}

cmd="${1:-train}"
shift || true
case "$cmd" in
  train) setup; exec "$VENV/bin/ringpipe" train "$@" ;;
  # The suite starts hundreds of interpreters (ranks, launchers, CLIs): where the environment says
  # PYTHONDONTWRITEBYTECODE, each would compile ringpipe's modules and pytest would rewrite every
  # test module again on each run; the compiled files go to __pycache__ (git-ignored).
  # It runs on one pytest-xdist worker per core, at most 4 (RINGPIPE_TEST_WORKERS=N to choose; a
  # -n given here wins): each test file stays on one worker, see tests/conftest.py.
  test) setup; setup_tests; unset PYTHONDONTWRITEBYTECODE
        cores="$(nproc 2>/dev/null || echo 1)"
        workers="${RINGPIPE_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
        if [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadgroup "$@"; fi
        exec "$VENV/bin/python" -m pytest "$@" ;;
  setup) setup; setup_tests ;;
  *) echo "usage: ./run.sh train|test|setup [args]" >&2; exit 2 ;;
esac
