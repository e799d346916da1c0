#!/bin/bash
# Horovod's own tests against ringpipe: 2 ranks over gloo on the CPU, every rank running pytest,
# as `horovodrun -np 2 pytest` does. The shim (shim/horovod) only re-exports ringpipe's modules under
# Horovod's names and supplies three helpers the tests import from Horovod's internals.
#
#   conformance/horovod_tests/run.sh HOROVOD_CHECKOUT test_torch.py [pytest args...]
#   (test_tensorflow.py, test_tensorflow2_keras.py...; TF_USE_LEGACY_KERAS=1 for tf-keras;
#    RINGPIPE_BACKEND=mpi for MPI)
#
# HOROVOD_CHECKOUT is a clone of github.com/horovod/horovod; the tests need pytest-timeout,
# parameterized, mock, cloudpickle and packaging. Results go to ./horovod-tests-out/.
set -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
checkout=$(cd "$1" && pwd); file=$2; shift 2
out=$PWD/horovod-tests-out; mkdir -p "$out"
cd "$checkout/test/parallel"
export PYTHONPATH="$here/shim:$checkout/test/utils:$checkout/test/parallel${PYTHONPATH:+:$PYTHONPATH}" CUDA_VISIBLE_DEVICES=
ringpipe launch -n 2 --backend "${RINGPIPE_BACKEND:-gloo}" -m pytest -p no:cacheprovider -p no:randomly -rA -q --timeout=240 \
  "$file" "$@" 2>&1 | tee "$out/${file%.py}.log"
