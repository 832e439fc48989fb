#!/usr/bin/env bash
# The GPU check: the GPU tests, then the GPU figures, in at most 6 minutes on one H100 or H200.
#
#     bash benchmarks/gpu_check.sh
#
# 1. tests/core/test_gpu.py (statistics against a float64 CPU reference, compiled (Triton) and eager
#    statistics agreeing, AMP fp16 with a GradScaler, precision="16-mixed" with a fused Adam
#    logging the norms of an unfused one within 1 %, offload bitwise equal with a lower
#    torch.cuda.max_memory_allocated, the in-place refusal, no growth of memory or files over 50
#    logged and offloaded steps) and the CUDA test of tests/offload/test_offload.py;
# 2. the floor: benchmarks/floor.py --device cuda, compiled and eager statistics side by side, in
#    reads of the gradient bytes (targets: at most 2 without histograms, 8 with);
# 3. the figures: benchmarks/logged_step.py --device cuda on ResNet-50 and GPT-2 small (built
#    from transformers' configs, no download): bare, logged and offloaded steps, their step
#    time, ratio to bare, what a logged step adds per watched module (us) and peak device memory.
#    Each window runs in a fresh process (2 rounds: 6 processes per model).
# Each part runs under its own time limit. Without CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing checked."
    exit 0
fi
date -u +"gpu_check: %Y-%m-%d %H:%M UTC"
git log -1 --format="commit %h %s" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"

status=0
run() {  # run LIMIT_S NAME COMMAND...: a time limit, and the status remembered
    local limit=$1 name=$2
    shift 2
    echo
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    [ $rc -eq 124 ] && echo "gpu_check: $name ran past ${limit}s and was stopped"
    echo "== $name: exit $rc after $((SECONDS - start))s"
    [ $rc -ne 0 ] && status=1
    return 0
}

run 120 "GPU tests" python -m pytest -q -rs -p no:cacheprovider tests/core/test_gpu.py \
    "tests/offload/test_offload.py::test_cuda_roundtrip_and_grads"
run 40 "the floor, compiled and eager" python benchmarks/floor.py --device cuda --rounds 3
for model in resnet50 gpt2; do
    run 100 "GPU figures, $model" python benchmarks/logged_step.py --device cuda --models "$model" \
        --variants bare,logged,offload --rounds 2 --steps 5
done
exit $status
