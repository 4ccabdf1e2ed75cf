#!/usr/bin/env bash
# Issue 18 on a fresh GPU box, in one command (~20-25 min on one H100; README: On a GPU):
#   bash benchmarks/gpu_session.sh OUT_DIR [LAYERS]
# 1) installs a CUDA build of torch from the box's package index (no CPU constraint) and odmoe[dev];
# 2) the gpu-marked unit tests (slots, kernels, main and shadow on CUDA) -> OUT_DIR/gpu-tests.txt;
# 3) odmoe-bench suite=gpu on a LAYERS-layer (default 4) real-width Mixtral-shaped bf16 model
#    -> OUT_DIR/gpu.json, OUT_DIR/gpu.png, OUT_DIR/gpu-bench.txt;
# 4) the gpu-marked whole-cluster tests (every family) -> OUT_DIR/gpu-cluster-tests.txt.
# Each step's time and exit status go to OUT_DIR/session.txt; a failing step does not stop the next.
set -u
OUT=${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR [LAYERS]}
LAYERS=${2:-4}
mkdir -p "$OUT"
LOG="$OUT/session.txt"
step() {  # step NAME TIMEOUT_S COMMAND...: run, log time and status
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
  tail -n 5 "$OUT/$name.txt"
}
echo "gpu session $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)" | tee "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
# torch from the index as is: on Linux x86_64 PyPI's torch wheel is the CUDA build. Same version as
# constraints-cpu.txt pins for CPU machines; bitsandbytes and accelerate come with odmoe[dev].
step install 900 bash -c 'pip install -q "torch==2.13.0" && pip install -q -e ".[dev]"'
python -c 'import torch, transformers, bitsandbytes, accelerate; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0)); print("transformers", transformers.__version__, "bitsandbytes", bitsandbytes.__version__, "accelerate", accelerate.__version__)' 2>&1 | tee -a "$LOG"
PYTEST=(python -m pytest tests/test_gpu.py -q --timeout 300 -o addopts="--strict-markers -p no:cacheprovider --durations=15")
step gpu-tests 420 "${PYTEST[@]}" -m "gpu and not integration" --junitxml="$OUT/gpu-tests.xml"
step gpu-bench 900 odmoe-bench suite=gpu gpu.layers="$LAYERS" results_dir="$OUT" gpu.model_dir=/tmp/odmoe-gpu-model
step gpu-cluster-tests 600 "${PYTEST[@]}" -m "gpu and integration" --junitxml="$OUT/gpu-cluster-tests.xml"
echo "done $(date -u +%FT%TZ)" | tee -a "$LOG"
