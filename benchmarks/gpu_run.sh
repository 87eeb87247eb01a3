#!/usr/bin/env bash
# One device call: GPU tests, then the linear-compression benchmark. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ikbo_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c 'import jax; print(jax.__version__, jax.devices())'
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests -m gpu -rA 2>&1 \
  | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 25 "$OUT/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-330}" python3 -m benchmarks.linear_compression \
  --out "$OUT/linear_compression_h200.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^B \|^ratio " 
tail -n 14 "$OUT/bench.log"
