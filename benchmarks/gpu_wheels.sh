#!/usr/bin/env bash
# Run HERE (a machine where pip reaches the package registry), in the checkout the GPU session sends,
# before a GPU session (README: On a GPU). The GPU box has no network: what odmoe needs there beyond
# its image (KINDS.md: Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, accelerate, numpy,
# safetensors, tokenizers, msgpack, psutil, xxhash, httpx, matplotlib, prometheus-client, pytest,
# pytest-timeout, hypothesis, click, h11, typer, huggingface-hub 1.33, ...) travels as wheels in the
# git-ignored folder .whl/, named in the device call's `carry`.
#
#   bash benchmarks/gpu_wheels.sh            # -> .whl/ (cp312, manylinux x86_64), size vs 64 MiB
#
# Environment: PYVER (default 3.12, the box's), WHL_DIR (default .whl; another folder is for a local
# check with another Python, e.g. PYVER=3.11 WHL_DIR=/tmp/whl311), BNB=0 (no bitsandbytes: the int8
# and nf4 GPU tests then skip), BNB_KEEP (the bitsandbytes libraries kept, default "cpu cuda130
# cuda132"), PYTHON (the pip used here, default python3; it only downloads, installs nothing).
#
# Not carried, on purpose: torch (the box's 2.11.0+cu130), ruff and grpcio-tools (lint and codegen,
# CPU CI only), ray (role=ray; tests/test_ray_cluster.py is CPU-only), openai (the HTTP API tests,
# not in tests/test_gpu.py; it would need httpx2 and more), lz4/zipnn (the compression suite).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python3}
PYVER=${PYVER:-3.12}
WHL_DIR=${WHL_DIR:-.whl}
BNB=${BNB:-1}
BNB_KEEP=${BNB_KEEP:-cpu cuda130 cuda132}
BUDGET=$((64 * 1024 * 1024))

# One version of each (two of one name stop the offline install). Each: why the box needs it.
WHEELS=(
  transformers==5.24.0           # box: 5.17.0; constraints-cpu.txt pins it (batched decode: `cache=`)
  pyzmq==27.3.0                  # missing: the data plane
  grpcio==1.85.1                 # box's version unknown; odmoe_pb2_grpc.py needs >=1.85.1
  grpcio-health-checking==1.85.1 # missing; needs grpcio>=1.85.1, protobuf>=7.35.1
  protobuf==7.36.2               # box's unknown; odmoe_pb2.py's gencode 7.35.1 needs 7.x >= 7.35.1
  hydra-core==1.3.8              # missing: every command's config
  omegaconf==2.3.1               # hydra-core
  zstandard==0.25.0              # missing: compressed expert transfers
  fastapi==0.165.0               # missing: main's HTTP API (on by default)
  starlette==1.10.0              # fastapi, sse-starlette
  pydantic==2.13.4               # fastapi
  pydantic-core==2.46.4          # pydantic (exact pin)
  annotated-types==0.7.0         # pydantic
  typing-inspection==0.4.2       # pydantic, fastapi
  opentelemetry-api==1.45.2      # fastapi 0.165 imports it in fastapi.applications
  uvicorn==0.54.0                # missing: serves the HTTP API (click, h11: on the box)
  sse-starlette==3.7.0           # missing: streamed completions
  anyio==4.16.0                  # box's unknown; sse-starlette needs >=4.7
  typing-extensions==4.16.0      # box's unknown; anyio 4.16 needs >=4.16, pydantic >=4.14.1
  cryptography==48.0.0           # missing: odmoe-keys, authenticated transport
  cffi==2.0.0                    # cryptography (>=2.0.0)
  pycparser==3.0                 # cffi
  greenlet==3.5.6                # missing: main and the shadow step batched requests (lockstep.py)
  regex==2026.5.9                # box's unknown; transformers 5.24 needs >=2025.10.22
  gguf==0.19.0                   # missing: GGUF files (issue 46; numpy, pyyaml, requests, tqdm: on the box)
)
# Published as a source archive only (pure Python): built into a wheel here.
SDISTS=(
  antlr4-python3-runtime==4.9.3  # hydra-core and omegaconf pin 4.9.*
)
BNB_PIN=bitsandbytes==0.50.2     # missing; 43 MB as published (every CUDA/ROCm/XPU build): slimmed below

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
DL=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp
    "${PLATFORMS[@]}")

if [ "$WHL_DIR" = .whl ]; then  # never committed, never sent by accident: carried on purpose only
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi
rm -rf "$WHL_DIR"
mkdir -p "$WHL_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "downloading ${#WHEELS[@]} wheels for cp${PYVER/./} manylinux x86_64 into $WHL_DIR"
"${DL[@]}" -d "$WHL_DIR" "${WHEELS[@]}"
for s in "${SDISTS[@]}"; do
  "$PY" -m pip wheel -q --no-deps --no-binary "${s%%==*}" -w "$WHL_DIR" "$s"
done

if [ "$BNB" != 0 ]; then
  "${DL[@]}" -d "$tmp" "$BNB_PIN"
  # The published wheel holds a library per CUDA, ROCm and XPU version (129 MB unpacked). bitsandbytes
  # loads libbitsandbytes_cuda<torch.version.cuda>.so (cuda130 for the box's torch 2.11.0+cu130; the
  # BNB_CUDA_VERSION variable can name another) and libbitsandbytes_cpu.so: keep those, drop the rest
  # and their RECORD lines. Same name and version; pip does not check RECORD's hashes.
  BNB_KEEP="$BNB_KEEP" "$PY" - "$tmp"/bitsandbytes-*.whl "$WHL_DIR" <<'EOF'
import os, re, sys, zipfile
src, dest_dir = sys.argv[1], sys.argv[2]
keep = {f"bitsandbytes/libbitsandbytes_{k}.so" for k in os.environ["BNB_KEEP"].split()}
lib = re.compile(r"bitsandbytes/libbitsandbytes_[^/]+\.so$")
dest = os.path.join(dest_dir, os.path.basename(src))
dropped = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        name = info.filename
        if lib.match(name) and name not in keep:
            dropped += 1
            continue
        data = zin.read(name)
        if name.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not (lib.match(l.split(",")[0]) and l.split(",")[0] not in keep)).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
missing = keep - set(zipfile.ZipFile(dest).namelist())
if missing:
    sys.exit(f"bitsandbytes wheel lacks {sorted(missing)}")
print(f"bitsandbytes: kept {sorted(keep)}, dropped {dropped} other libraries "
      f"({os.path.getsize(src) / 2**20:.1f} -> {os.path.getsize(dest) / 2**20:.1f} MiB)")
EOF
else
  echo "BNB=0: no bitsandbytes (tests/test_gpu.py's int8/nf4 tests will skip)"
fi

# One of each name, exactly the pins above.
"$PY" - "$WHL_DIR" <<'EOF'
import collections, os, sys
names = collections.Counter(f.split("-")[0].lower() for f in os.listdir(sys.argv[1]) if f.endswith(".whl"))
dups = [n for n, c in names.items() if c > 1]
if dups:
    sys.exit(f"two versions of {dups} in {sys.argv[1]}")
EOF

# What a device call sends: the tracked tree, untracked files git does not ignore, shared/ (if the
# checkout has one), and the carried .whl/. All of it must stay under 64 MiB.
sum_files() { "$PY" -c 'import os,sys; print(sum(os.path.getsize(p) for p in sys.stdin.read().split("\0") if p and os.path.isfile(p)))'; }
tracked=$(git ls-files -z | sum_files)
untracked=$(git ls-files -z -o --exclude-standard | sum_files)
shared=0
[ -d shared ] && shared=$(find shared -type f -print0 | sum_files)
wheels=$(find "$WHL_DIR" -type f -print0 | sum_files)
total=$((tracked + untracked + shared + wheels))
mib() { awk -v b="$1" 'BEGIN { printf "%6.1f MiB", b / 1048576 }'; }
echo
ls -l "$WHL_DIR" | awk 'NR > 1 { printf "  %8.2f MiB  %s\n", $5 / 1048576, $9 }'
echo "  $(mib "$wheels")  $WHL_DIR/ ($(ls "$WHL_DIR" | wc -l) wheels)"
echo "  $(mib "$tracked")  tracked tree ($(git ls-files | wc -l) files; benchmarks/results: $(mib "$(git ls-files -z benchmarks/results | sum_files)"))"
echo "  $(mib "$untracked")  untracked, not ignored"
[ "$shared" != 0 ] && echo "  $(mib "$shared")  shared/"
echo "  $(mib "$total")  in all, of the device call's 64 MiB"
if [ "$total" -ge "$BUDGET" ]; then
  echo "OVER the 64 MiB a device call may send: try BNB=0, or carry less" >&2
  exit 1
fi
