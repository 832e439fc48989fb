#!/usr/bin/env bash
# The GPU check: the GPU tests, then the GPU figures, in at most 6 minutes on one H100 or H200.
#
#     bash benchmarks/gpu_check.sh
#
# The GPU tests (tests/core/test_gpu.py, the CUDA offload test), the
# floor (benchmarks/floor.py: reads of the gradient bytes), and the figures of ResNet-50 and GPT-2
# small (benchmarks/logged_step.py: bare, logged, offloaded and spikes steps, the last under
# set_sync_debug_mode("error"): a step that waits for the device fails).
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
        --variants bare,logged,offload,spikes --rounds 2 --steps 5
done
exit $status
