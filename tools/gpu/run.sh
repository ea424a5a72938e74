#!/usr/bin/env bash
# The GPU kit on a lent GPU machine, in one call: install the carried wheels, say what the machine
# is, check the imports (seconds), then run benchmarks/gpu.py into OUTDIR (results.json,
# results.md, gpu.log, and this script's own output in run.log). See docs/benchmarks.md, "GPU".
#
#   bash tools/gpu/run.sh OUTDIR [benchmark arguments...]
#
# GPU_WHEELS_DIR: the folder of wheels carried to the machine (default .whl; tools/gpu/wheels.txt
# lists what the run needs). The benchmark's own budget (--budget-s, default 420 s) leaves room
# within the device call's 10 minutes for the install and the imports.
set -euo pipefail

out=${1:?usage: bash tools/gpu/run.sh OUTDIR [benchmark arguments...]}
shift
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1

wheels=${GPU_WHEELS_DIR:-.whl}
site=/tmp/site
shopt -s nullglob
found=("$wheels"/*.whl)
if [ ${#found[@]} -eq 0 ]; then
    echo "no wheels in $wheels (set GPU_WHEELS_DIR, or carry .whl: see tools/gpu/wheels.txt)" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${found[@]}"
export PYTHONPATH="$site:$PWD"

nvidia-smi || true
python3 - <<'PY'
import importlib
import sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
failed = []
# What the kit imports: an error here ends the run in seconds. torchao serves part f alone, so
# without it the run goes on (part f records the error).
for name in ("msgspec", "zmq", "janus", "uvloop", "psutil", "huggingface_hub", "transformers", "diffusers",
             "torchao", "omni_runtime.config", "omni_runtime.entrypoints.omni",
             "omni_runtime.stage.runners.diffusion", "benchmarks.gpu"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')}")
    except Exception as e:
        (print if name == "torchao" else failed.append)(f"{name}: {type(e).__name__}: {e}")
if not torch.cuda.is_available():
    failed.append("torch sees no CUDA device")
if failed:
    sys.exit("cannot run the GPU kit:\n  " + "\n  ".join(failed))
PY

python3 -m benchmarks.gpu --out "$out" "$@"
