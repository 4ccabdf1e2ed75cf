#!/usr/bin/env bash
# Issue 18 on a lent GPU box that has no network (README: On a GPU). Two steps:
#   here:   bash benchmarks/gpu_wheels.sh      # the wheels odmoe needs beyond the box's image -> .whl/
#   there:  one device call per part, each with carry [".whl"], each well under a call's 10 minutes
#           (timeout_s for the call: 420, 590, 510; 30 min of device time covers the three and a start):
#     bash benchmarks/gpu_session.sh "$OUT" part1           # install, versions, gpu unit tests (<=300 s)
#     bash benchmarks/gpu_session.sh "$OUT" part2 [LAYERS]  # install, odmoe-bench suite=gpu (<=500 s;
#                                                           #   LAYERS default 4, 2 for a safe first run)
#     bash benchmarks/gpu_session.sh "$OUT" part3           # install, gpu whole-cluster tests (<=420 s)
#   also:   batched (issue 28, one call, timeout_s 420: the batched-decode gpu tests, then main's time
#           per token with main on the GPU, batched vs per request, on a wide random model made there:
#           gpu-batched-tests.txt/.xml, main-decode-cuda.txt),
#           gguf (issue 46, one call, timeout_s 600: GGUF decode with every node on the GPU, the GGUF
#           gpu tests, the same decode on the box's 16 CPU cores: gguf-link-cuda/-cpu .txt/.json, gguf-tests),
#           memory (issue 45, one call, timeout_s 580: every gpu test, then benchmarks/gpu_memory.py on a
#           real-width model made there: gpu-tests.txt/.xml, gpu-memory.txt/.json),
#           install (install and versions only; runs without a GPU too), all (part1..3 in a row, for a
#           box with no 10-minute limit: ~15-20 min), lease (one call for a 15-minute lease, timeout_s
#           600: every gpu test at once on the box's cores within TESTS_S=240 s, then suite gpu at
#           LAYERS within BENCH_S=320 s; writes session, gpu-tests .txt/.xml, gpu-bench.txt, gpu.json/.png;
#           SYSTEMS: suite gpu's systems, comma-separated, e.g. the same-budget sweep of issue 30:
#           SYSTEMS=single_process,odmoe_cache_2,lru_offloader_8 BENCH_ARGS='gpu.workers=2 gpu.group_size=1').
# Install (offline, every part: the box may be a fresh one): .whl/*.whl into $SITE (default /tmp/site)
# with PYTHONPATH=$SITE ahead of the image's packages, then odmoe itself editable into the box's Python
# (--no-index --no-build-isolation: the image's setuptools builds it). Every part writes
# $OUT/session.txt (install log, versions, each step's time and exit status) and its steps' logs:
#   part1: gpu-tests.txt, gpu-tests.xml        part2: gpu-bench.txt, gpu.json, gpu.png
#   part3: gpu-cluster-tests.txt, gpu-cluster-tests.xml       (all: those 8 files, the most a call returns)
# A step is bounded by `timeout`; a failing or timed-out step does not stop the next. BENCH_ARGS: more
# odmoe-bench words for part2 (e.g. the CPU dry run: gpu.device=cpu gpu.hidden=64 gpu.intermediate=128 ...).
set -u
OUT=${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR part1|part2|part3|lease|install|all [LAYERS]}
PART=${2:-all}
LAYERS=${3:-4}
SITE=${SITE:-/tmp/site}
WHL=${WHL:-.whl}  # another folder: a local check with wheels for another Python
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
LOG="$OUT/session.txt"
t_start=$SECONDS

say() { echo "$*" | tee -a "$LOG"; }
step() {  # step NAME LIMIT_S COMMAND...: run bounded, log to $OUT/NAME.txt, record time and status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  say "-- $name (limit ${limit}s, at +$((SECONDS - t_start))s): $*"
  # to a file, not a pipe: a node process that outlives its step cannot hold the step open
  timeout -k 20 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  local why=""
  [ $rc = 124 ] || [ $rc = 137 ] && why=" (TIMED OUT)"
  tail -n 25 "$OUT/$name.txt"
  say "-- $name: rc=$rc in $((SECONDS - t0))s$why"
}

install() {
  if ! ls "$WHL"/*.whl > /dev/null 2>&1; then
    say "no .whl/*.whl here: run 'bash benchmarks/gpu_wheels.sh' on the CPU machine and carry [\".whl\"]"
    exit 3
  fi
  local t0=$SECONDS
  # idempotent on a warm box: the same wheels are installed once
  local stamp
  stamp=$(ls -l "$WHL"/*.whl | md5sum | cut -c1-32)
  if [ "$(cat "$SITE/.odmoe-wheels" 2>/dev/null)" != "$stamp" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHL"/*.whl >> "$LOG" 2>&1 || { say "installing $WHL/ into $SITE failed (see above)"; exit 3; }
    echo "$stamp" > "$SITE/.odmoe-wheels"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  # odmoe itself and the suites beside it (odmoe_bench): editable, so that the package-dir mappings
  # (odmoe.nodes -> nodes/, odmoe_bench -> benchmarks/, ...) hold while tests import from the repo
  # root (where ./odmoe would shadow a copy installed elsewhere)
  "$PY" -m pip install -q --no-deps --no-index --no-build-isolation -e . -e ./benchmarks >> "$LOG" 2>&1 \
    || { say "installing odmoe (pip install -e . -e ./benchmarks offline) failed (see above)"; exit 3; }
  say "installed in $((SECONDS - t0))s (PYTHONPATH=$PYTHONPATH)"
  "$PY" - >> "$LOG" 2>&1 <<'EOF'
import importlib, importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
import torch
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", cuda,
      torch.cuda.get_device_name(0) if cuda else "-")
for name in ("transformers", "accelerate", "bitsandbytes", "huggingface_hub", "tokenizers", "safetensors",
             "grpcio", "protobuf", "pyzmq", "hydra-core", "fastapi", "pydantic", "numpy", "pytest"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
import transformers
print("transformers from", transformers.__file__)
for mod in ("odmoe.nodes.worker", "odmoe.nodes.main", "odmoe.launch.cli", "odmoe_bench.suites.gpu",
            "odmoe.rpc.odmoe_pb2_grpc", "grpc_health.v1.health", "fastapi", "uvicorn", "sse_starlette",
            "zmq", "zstandard", "cryptography.x509", "hydra"):
    try:
        importlib.import_module(mod)
        print(f"  import {mod}: ok")
    except Exception as e:
        print(f"  import {mod}: FAILED {type(e).__name__}: {e}")
try:
    import bitsandbytes as bnb
    if cuda:
        w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        q, state = bnb.functional.quantize_4bit(w, quant_type="nf4")
        err = (bnb.functional.dequantize_4bit(q, state) - w).abs().max().item()
        print(f"  bitsandbytes nf4 on cuda: ok (max error {err:.3g})")
except Exception as e:
    print(f"  bitsandbytes: FAILED {type(e).__name__}: {e} (int8/nf4 tests will fail or skip)")
EOF
  sed -n '/^python /,$p' "$LOG" | tail -n 40
}

PYTEST=("$PY" -m pytest tests/test_gpu.py -q -p no:cacheprovider --timeout 240
        -o "addopts=--strict-markers --durations=15")
part1() {  # the gpu-marked unit tests: slots, kernels (180 cases), main and shadow on CUDA (~1-3 min)
  step gpu-tests 300 "${PYTEST[@]}" -m "gpu and not integration" --junitxml="$OUT/gpu-tests.xml"
}
part2() {  # suite gpu. Its model: LAYERS x 8 experts x 352 MB, bf16 (4 layers: 11.3 GB, 2: 5.6 GB),
  # filled from a seeded pool and written to /tmp (about a minute at 4 layers, most of it the write),
  # then odmoe, one process, accelerate offload and the LRU offloader in turn (est. 5-8 min at 4
  # layers, 3-5 at 2; its JSON and figure are written at the end only).
  step gpu-bench 500 "$PY" -m odmoe_bench.cli suite=gpu gpu.layers="$LAYERS" results_dir="$OUT" \
    gpu.model_dir="/tmp/odmoe-gpu-model-$LAYERS" gpu.timeout_s=400 ${BENCH_ARGS:-}
  df -h /tmp | tail -n 1 | tee -a "$LOG"
}
part3() {  # the gpu-marked whole-cluster tests: every family + 3 quantized shadows (~3-6 min)
  step gpu-cluster-tests 420 "${PYTEST[@]}" -m "gpu and integration" --junitxml="$OUT/gpu-cluster-tests.xml"
}
lease() {  # all of it in one call of a 15-minute lease (timeout_s 600): every gpu test at once, spread
  # over the box's cores (pytest-xdist, in its image; nodes bind port 0), then suite gpu with the
  # systems in the order that matters most (the reference first; the suite writes its JSON after each
  # system, so a system cut off by the step's limit leaves the others' figures)
  local workers=()
  "$PY" -c "import xdist" 2> /dev/null && workers=(-n "${XDIST:-8}")
  local only=()  # TESTS_K: a -k expression, to rerun some tests on a second call
  [ -n "${TESTS_K:-}" ] && only=(-k "$TESTS_K")
  step gpu-tests "${TESTS_S:-240}" "${PYTEST[@]}" "${workers[@]}" "${only[@]}" -m gpu --junitxml="$OUT/gpu-tests.xml"
  step gpu-bench "${BENCH_S:-320}" "$PY" -m odmoe_bench.cli suite=gpu gpu.layers="$LAYERS" results_dir="$OUT" \
    gpu.model_dir="/tmp/odmoe-gpu-model-$LAYERS" gpu.timeout_s=240 \
    "gpu.systems=[${SYSTEMS:-single_process,odmoe,odmoe_cache,lru_offloader,accelerate_offload}]" ${BENCH_ARGS:-}
}

batched() {  # issue 28 on the GPU: its tests (in-process engines on CUDA, concurrent GPU clusters),
  # then benchmarks/main_decode.py with main on CUDA over a model of real attention width (hidden
  # 4096, 32 heads, 8 KV heads; experts 128 wide: the in-process workers compute them on the CPU
  # in bf16, and 1024 wide took ~80 ms of wall time per token there, more than the call had)
  local workers=()
  "$PY" -c "import xdist" 2> /dev/null && workers=(-n "${XDIST:-8}")
  step gpu-batched-tests "${TESTS_S:-180}" "${PYTEST[@]}" "${workers[@]}" -rP -m gpu \
    -k "batched or concurrent" --junitxml="$OUT/gpu-batched-tests.xml"
  local model=/tmp/odmoe-wide-attention-128
  step make-wide "${MAKE_S:-60}" "$PY" -c "from odmoe.tools.model_factory import ModelSpec, make_wide_model
make_wide_model(ModelSpec(layers=4, hidden=4096, intermediate=128, heads=32, kv_heads=8, vocab=4096,
                          max_positions=1024, dtype='bfloat16'), '$model')"
  step main-decode-cuda "${BENCH_S:-200}" "$PY" -m odmoe_bench.main_decode --model "$model" \
    --device cuda --dtype bfloat16 --users "${USERS:-1,2,4,8,16}" --rounds 2 --tokens 24
}

memory() {  # issue 45 in one call of a 15-minute lease (timeout_s 580): every gpu test at once (the
  # workers' host stores now hold only their homes, the shadow is built layer by layer: both on CUDA
  # here), then each node's memory with every node on the GPU at real Mixtral width (MEM_LAYERS
  # layers x 8 experts x 352 MB, bf16: 2 layers 5.6 GB) beside one process: gpu-memory.txt/.json
  local workers=()
  "$PY" -c "import xdist" 2> /dev/null && workers=(-n "${XDIST:-8}")
  step gpu-tests "${TESTS_S:-200}" "${PYTEST[@]}" "${workers[@]}" -m gpu --junitxml="$OUT/gpu-tests.xml"
  local model="/tmp/odmoe-mem-${MEM_LAYERS:-2}"
  step make-wide "${MAKE_S:-100}" "$PY" -c "from odmoe.tools.model_factory import ModelSpec, make_wide_model
make_wide_model(ModelSpec(layers=${MEM_LAYERS:-2}, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                          vocab=4096, dtype='bfloat16'), '$model')"
  step gpu-memory "${MEM_S:-200}" "$PY" -m odmoe_bench.gpu_memory --model "$model" --out "$OUT/gpu-memory.json"
}

gguf() {  # issue 46 in one call of a 15-minute lease (timeout_s 600): benchmarks/gguf_link.py with every
  # node on the GPU (bf16 safetensors vs Q8_0 vs Q4_K experts over the emulated 8 Gbit/s link, the
  # workers dequantizing on the GPU; tokens against transformers on the GPU), the GGUF gpu tests,
  # then the same benchmark with every node on the box's CPUs (16 cores, not this project's 2)
  step gguf-link-cuda "${CUDA_S:-230}" "$PY" -m odmoe_bench.gguf_link --device cuda --out "$OUT/gguf-link-cuda.json"
  step gguf-tests "${TESTS_S:-150}" "${PYTEST[@]}" -rA -m gpu -k gguf --junitxml="$OUT/gguf-tests.xml"
  step gguf-link-cpu "${CPU_S:-200}" "$PY" -m odmoe_bench.gguf_link --device cpu --out "$OUT/gguf-link-cpu.json"
}

say "gpu session $PART $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), layers $LAYERS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
install
case "$PART" in
  install) ;;
  part1) part1 ;;
  part2) part2 ;;
  part3) part3 ;;
  lease) lease ;;
  batched) batched ;;
  memory) memory ;;
  gguf) gguf ;;
  all) part1; part2; part3 ;;
  *) say "unknown part '$PART': part1|part2|part3|lease|install|all"; exit 2 ;;
esac
say "done $PART in $((SECONDS - t_start))s $(date -u +%FT%TZ)"
