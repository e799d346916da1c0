#!/usr/bin/env bash
# The GPU checks and measurements, run in one go on a CUDA machine from the repository root:
#
#   bash benchmarks/gpu_session.sh STAGE [STAGE ...]      (output also under $OUT when set)
#
# Stages: env (GPU, torch, NCCL), tests (the cuda-marked tests),
# nccl2 (whether two NCCL ranks may share one GPU), bench (ringpipe bench over NCCL on as many
# ranks as GPUs), dp1/dp2 (DistributedOptimizer against DDP on the GPU), profile (where a step's
# time goes on the GPU, by torch.profiler), pipeline (the pipeline doctor's heavy-stage case on
# 3 and 4 stages with a core per stage: is the recommended split measured faster?), suite (the
# whole test suite on the GPU host). Uses the machine's own python3 with torch; ringpipe is taken from src/.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PY:-python3}

stage_env() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
    nproc; uname -r
}

stage_tests() {
    timeout 420 $PY -m pytest -q -p no:cacheprovider --timeout=240 -m cuda tests 2>&1 | tee "$OUT/tests_cuda.log" | tail -40
}

stage_nccl2() {
    cat > /tmp/nccl2.py <<'EOF2'
import torch
from ringpipe.launch import spawn

def f(comm):
    t = torch.ones(4, device="cuda") * (comm.rank + 1)
    comm.allreduce(t, "sum")
    return t.tolist()

if __name__ == "__main__":
    try:
        print("two NCCL ranks on one GPU:", spawn(f, 2, backend="nccl"))
    except Exception as exc:  # the refusal is what is being probed
        print("two NCCL ranks on one GPU refused:", type(exc).__name__, str(exc)[:600])
EOF2
    timeout 120 $PY /tmp/nccl2.py 2>&1 | tail -4
}

stage_bench() {
    # One NCCL rank per GPU: the own algorithms against NCCL's allreduce (at one GPU, call costs only).
    gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
    timeout 200 ringpipe bench allreduce -n "$gpus" --backend nccl -b 4K -e 64M -f 4 -r 5 2>&1 | tail -30
}

# DistributedOptimizer against DDP with the models on the GPU: one rank over NCCL (dp1), two
# ranks sharing the GPU over gloo, CUDA tensors through gloo (dp2).
stage_dp1() {
    timeout 280 $PY benchmarks/dp_vs_ddp.py --device cuda --backend nccl --ranks 1 --runs 3 --blocks 4 \
        --models small,mlp,resnet,transformer --json "$OUT/dp_cuda_nccl1.json" 2>&1 | grep -v Warning | tail -16
}

stage_dp2() {
    timeout ${DP2_S:-280} $PY benchmarks/dp_vs_ddp.py --device cuda --backend gloo --ranks 2 --runs ${DP2_RUNS:-3} --blocks 4 \
        --models small,mlp,resnet,transformer --json "$OUT/dp_cuda_gloo2.json" 2>&1 | grep -v Warning | tail -16
}

stage_profile() {
    # Where one step's time goes on the GPU, ringpipe against DDP, one rank (kernel launches,
    # synchronisations, operators); Chrome traces under $OUT.
    for m in small mlp; do
        timeout 150 $PY benchmarks/dp_breakdown.py --by profiler --models $m --device cuda --steps 20 --trace "$OUT/$m" 2>&1 \
            | grep -v USDT | cut -c1-150 | head -30
    done
}

stage_pipeline() {
    # The doctor's heavy-stage case where each stage has cores of its own (on 2 cores, 3 and 4
    # stages share them and no split can be faster): heavy stage named, split recommended, and
    # the recommendation measured by --verify, ${PIPE_TRIALS:-10} trials per stage count.
    timeout ${PIPE_S:-500} $PY benchmarks/pipeline_doctor.py --stages 3,4 --cases schedule --schedule-cases heavy \
        --trials ${PIPE_TRIALS:-10} 2>&1 | tee "$OUT/pipeline_doctor_heavy.log" | tail -30
}

stage_suite() {
    # The whole suite on a host with a GPU (tests whose outcome may depend on seeing one).
    timeout ${SUITE_S:-500} $PY -m pytest -v -p no:cacheprovider -n 14 --timeout=300 -m "not netns" tests > "$OUT/suite.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/suite.log" | grep -v "^\[gw" | tail -30; grep -c PASSED "$OUT/suite.log"
}

for s in "$@"; do
    echo "=== stage $s ($(date -u +%H:%M:%S))"
    "stage_$s"
done
echo "=== done ($(date -u +%H:%M:%S))"
