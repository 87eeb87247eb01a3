#!/usr/bin/env bash
# One device call: GPU tests, then the linear-compression benchmarks. Results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ikbo_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests -m gpu -rA 2>&1 \
  | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 25 "$OUT/gpu_tests.log"
if [ -n "${DIAGNOSTICS:-}" ]; then
  timeout 150 python3 -m benchmarks.lce_diagnostics --out "$OUT/lce_diagnostics.json" 2>&1 | tail -n 6
fi
timeout "${BENCH_TIMEOUT:-330}" python3 -m benchmarks.linear_compression ${BENCH_ARGS:-} \
  --out "$OUT/linear_compression_h200.json" > "$OUT/bench.log" 2>&1
tail -n 16 "$OUT/bench.log"
