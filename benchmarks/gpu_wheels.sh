#!/usr/bin/env bash
# What benchmarks/gpu_run.sh installs on a lent GPU machine that has no network, fetched here (with network) into
# .gpu-wheels/ (ignored by git), and the size of the call that carries them against its 64 MiB.
#
#   bash benchmarks/gpu_wheels.sh          # fetch (pip download --no-deps), then the size
#   bash benchmarks/gpu_wheels.sh --size   # the size only: working tree as git sends it + .gpu-wheels/
#   then: run(command="bash benchmarks/gpu_run.sh", carry=[".gpu-wheels"], timeout_s=580)
#
# The lent machine comes with torch 2.11 (CUDA 13), transformers 5.17, accelerate 1.15, typer, rich, nvidia-ml-py,
# and no bitsandbytes, hqq, fvcore or pytest. So the call carries:
#   transformers 5.24.0   ficoco's tested range is >=5.21,<5.25 (docs/install.md: 5.21 is where Video-LLaVA's
#                         images go in as pixel_values); 5.24.0 is the newest tested; 13.5 MB
#   huggingface_hub 1.33.0  transformers 5.24 needs >=1.31, 5.17 only >=1.5: installed where the machine's is older
#   bitsandbytes 0.50.2   int8/int4 weights; its wheel holds a native library per CUDA release (43 MB), so only
#                         those for CUDA GPU_WHEELS_BNB_CUDA (default 12.8, 13.0, 13.2) and the CPU one are kept
#   hqq 0.2.8.post1       transformers' quantized KV cache backend (int8/int4 rows); PyPI has only its sdist, built
#                         here into a pure-Python wheel (DISABLE_CUDA=1: no kernels), with termcolor, which it imports
#   pytest 9.2.0          the gpu-marked tests, with pluggy and iniconfig
# Not carried: lmms-eval (with datasets, pyarrow and the rest it needs, far above 64 MiB; its step is SKIPPED
# there with that reason) and fvcore (`ficoco flops --verify` only, which the GPU run does not use).
#
# Settings: PYTHON (default python3: its pip downloads; it needs setuptools to build hqq's wheel),
#           GPU_WHEELS_BNB_CUDA="128 130 132" (bitsandbytes' CUDA libraries kept).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DIR=.gpu-wheels
LIMIT=$((64 * 1024 * 1024))
BNB_CUDA=${GPU_WHEELS_BNB_CUDA:-128 130 132}
# Pure-Python wheels (any Python 3.11+ takes them: transformers 5.21 and later need 3.11), then the native one.
PURE=(transformers==5.24.0 huggingface_hub==1.33.0 termcolor==3.3.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)
NATIVE=(bitsandbytes==0.50.2)

die() { echo "error: $*" >&2; exit 2; }
[ "${1:-}" = "" ] || [ "$1" = --size ] || die "unknown argument '$1': give nothing, or --size"
command -v "$PYTHON" > /dev/null || die "PYTHON=$PYTHON: not found"
[[ "$BNB_CUDA" =~ ^[0-9\ ]+$ ]] || die "GPU_WHEELS_BNB_CUDA=$BNB_CUDA: give CUDA releases as digits, e.g. \"128 130\""

if [ "${1:-}" != --size ]; then
  mkdir -p "$DIR"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: --implementation py --abi none --platform any \
    --python-version 3.11 -d "$DIR" "${PURE[@]}"
  # Once slimmed (below), the wheel no longer has PyPI's hash, and pip would fetch all 43 MB again.
  ls "$DIR"/bitsandbytes-0.50.2-*.whl > /dev/null 2>&1 ||
    "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: -d "$DIR" "${NATIVE[@]}"
  if ! ls "$DIR"/hqq-0.2.8.post1-*.whl > /dev/null 2>&1; then
    sdist=$(mktemp -d)
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$sdist" hqq==0.2.8.post1
    DISABLE_CUDA=1 "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DIR" "$sdist"/hqq-*.tar.gz
    rm -rf "$sdist"
  fi
  # bitsandbytes without the native libraries of other CUDA releases, ROCm and XPU; RECORD rewritten to match.
  "$PYTHON" - "$DIR" "$BNB_CUDA" <<'PY'
import sys, zipfile
from pathlib import Path

folder, keep = Path(sys.argv[1]), {f"libbitsandbytes_cuda{v}.so" for v in sys.argv[2].split()}
keep.add("libbitsandbytes_cpu.so")
for wheel in folder.glob("bitsandbytes-*.whl"):
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
        dropped = [n for n in names if n.startswith("bitsandbytes/libbitsandbytes_") and n.split("/")[-1] not in keep]
        if not dropped:
            print(f"{wheel.name}: holds only the CUDA libraries {sorted(keep)}")
            continue
        slim = wheel.with_suffix(".slim")
        with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                if info.filename in dropped:
                    continue
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line + b"\n" for line in data.splitlines() if line.split(b",")[0].decode()
                                    not in dropped)
                target.writestr(info, data)
    before = wheel.stat().st_size
    slim.replace(wheel)
    print(f"{wheel.name}: {before / 1e6:.1f} MB -> {wheel.stat().st_size / 1e6:.1f} MB, keeping {sorted(keep)}")
PY
  echo "carried wheels in $DIR/:"
  find "$DIR" -name '*.whl' -printf '%s %p\n' | sort -k2 | awk '{printf "  %8.2f MB  %s\n", $1 / 1e6, $2}'
fi

# What the call sends: the working tree as git sees it (tracked files and untracked ones it does not ignore; the
# ignored build outputs stay behind) plus the carried folder.
"$PYTHON" - "$DIR" "$LIMIT" <<'PY'
import os, subprocess, sys
from pathlib import Path

folder, limit = Path(sys.argv[1]), int(sys.argv[2])
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
files = {os.fsdecode(f) for f in listed if f and os.path.isfile(f)}
tree = sum(os.path.getsize(f) for f in files)
carried = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
total = tree + carried
print(f"the call sends: working tree {tree / 1e6:.2f} MB ({len(files)} files) + {folder}/ {carried / 1e6:.2f} MB "
      f"= {total / 1e6:.2f} MB = {total / 2**20:.1f} MiB of 64 MiB ({total / limit:.0%}; "
      f"{(limit - total) / 2**20:.1f} MiB to spare)")
if total > limit:
    print("error: over the 64 MiB a call may send: drop a carried wheel, or untracked files from the tree")
    sys.exit(1)
PY
