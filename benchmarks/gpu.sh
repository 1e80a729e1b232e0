#!/usr/bin/env bash
# The GPU benchmark, in one run: JSON, markdown table and log to $OUT (default runs/bench).
#
#   OUT=/some/dir bash benchmarks/gpu.sh            # about 5 minutes on an H200
#   OUT=/some/dir bash benchmarks/gpu.sh --quick    # fewer steps, about half that
#
# Uses the machine's python3 (jax with CUDA, flax, optax, orbax-checkpoint, rich, safetensors;
# torch and lightning for their rows) and jaxnitro from this checkout's src/: nothing is
# installed. GPT-2 small (124M) trains in bf16 with cuDNN attention, through jaxnitro and by
# hand with the same model code (benchmarks/gpt.py); MFU is against 989 TFLOP/s.
# Afterwards, here: python benchmarks/run.py --record-from <OUT>/bench_gpu.json
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-runs/bench}"
mkdir -p "$out"
python="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    > "$out/nvidia-smi.csv" 2>&1 || true
"$python" benchmarks/run.py --gpu --out "$out/bench_gpu.json" "$@" 2>&1 | tee "$out/bench_gpu.log"
