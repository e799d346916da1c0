#!/usr/bin/env bash
# Build real Horovod 0.28.1 (Gloo only, PyTorch only) into its own virtual environment, as the peer
# of benchmarks/dp_vs_horovod.py. About 8 minutes on a 2-core machine; run it once, when asked:
#
#   bash benchmarks/horovod_peer/build.sh [VENV]        (default: $HOROVOD_VENV or ~/.cache/ringpipe-bench/horovod-0.28.1)
#
# Horovod 0.28.1 (the last release, 2023) does not build against torch >= 2.1 as released: its
# CMake asks for C++14 where PyTorch's headers need C++17. Upstream fixed this after the release
# (horovod PR #3998, commit 3a31d933 "Compile using C++17 when using PyTorch 2.1"); this script
# applies that commit's change to CMakeLists.txt and horovod/torch/CMakeLists.txt
# (pr3998-cxx17.patch beside it, taken from the commit as it is) to the PyPI sdist and builds it.
#
# torch is never installed unpinned: the environment reuses the torch of TORCH_PYTHON (default
# /work/main/.venv/bin/python, then the python3 on PATH): it is made with --system-site-packages from
# that interpreter's base Python, and a .pth file adds the site-packages that hold TORCH_PYTHON's
# torch (after the environment's own), so it sees what TORCH_PYTHON sees; it refuses to go on
# unless that torch is 2.13.0. Set HOROVOD_TORCH_PIN=1 to install torch==2.13.0 (CPU wheel) into the
# new environment instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-${HOROVOD_VENV:-$HOME/.cache/ringpipe-bench/horovod-0.28.1}}
torch_python=${TORCH_PYTHON:-/work/main/.venv/bin/python}
[ -x "$torch_python" ] || torch_python=$(command -v python3)
base_python=$("$torch_python" -c "import sys; print(sys.base_prefix)")/bin/python3
for tool in cmake g++ make; do
    command -v "$tool" >/dev/null || { echo "horovod_peer: '$tool' is needed to build Horovod; install it" >&2; exit 2; }
done

echo "== environment $venv (from $base_python)"
"$base_python" -m venv --system-site-packages "$venv"
py=$venv/bin/python
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ "${HOROVOD_TORCH_PIN:-0}" = 1 ]; then
    "$py" -m pip install --quiet "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
else
    torch_site=$("$torch_python" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    echo "$torch_site" > "$site/zz-reuse-torch.pth"   # after the environment's own packages
fi
version=$("$py" -c "import torch; print(torch.__version__)")
case $version in
    2.13.0*) echo "== torch $version" ;;
    *) echo "horovod_peer: torch $version found, 2.13.0 wanted (TORCH_PYTHON or HOROVOD_TORCH_PIN=1)" >&2; exit 2 ;;
esac
"$py" -m pip install --quiet setuptools wheel packaging psutil pyyaml cloudpickle cffi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "== horovod 0.28.1 source from PyPI"
"$py" -m pip download --quiet --no-deps --no-binary :all: --dest "$work" "horovod==0.28.1"
tar -xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
echo "== applying horovod PR #3998 (C++17 for PyTorch >= 2.1)"
patch -d "$work/horovod-0.28.1" -p1 < "$here/pr3998-cxx17.patch"

echo "== building (Gloo, PyTorch; no MPI, TensorFlow or MXNet)"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
       HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="-j$(nproc)"
"$py" -m pip install --no-build-isolation --no-deps --verbose "$work/horovod-0.28.1" > "$work/build.log" 2>&1 || {
    tail -60 "$work/build.log" >&2; echo "horovod_peer: the build failed (log above)" >&2; exit 1; }
"$venv/bin/horovodrun" --check-build
echo "== done: HOROVOD_VENV=$venv python benchmarks/dp_vs_horovod.py"
