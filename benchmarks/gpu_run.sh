#!/usr/bin/env bash
# One device call: benchmarks first (the numbers that matter most if the call is cut short),
# then GPU tests, diagnostics and the demo. Results go to $OUT.
# Set IKBO_COMMIT (the device copy has no .git); BENCH_ARGS=--no-sweeps for a short call.
set -uo pipefail
OUT=${OUT:-/tmp/ikbo_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > "$OUT/nvidia_smi.txt"
timeout "${BENCH_TIMEOUT:-240}" python3 -m benchmarks.linear_compression ${BENCH_ARGS:-} \
  --out "$OUT/linear_compression_h200.json" > "$OUT/bench.log" 2>&1
tail -n 13 "$OUT/bench.log"
timeout 200 python3 -m benchmarks.target_attention --out "$OUT/target_attention_h200.json" \
  ${ATTN_ARGS:-} > "$OUT/attention_bench.log" 2>&1
tail -n 6 "$OUT/attention_bench.log" | cut -c1-900
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests -m gpu -rA 2>&1 \
  | tail -n 40 > "$OUT/gpu_tests.log"
tail -n 4 "$OUT/gpu_tests.log"
timeout 60 python3 -m ikbo_jax.demo > "$OUT/demo.log" 2>&1; tail -n 5 "$OUT/demo.log"
timeout 60 python3 -m benchmarks.lce_diagnostics --out "$OUT/lce_diagnostics.json" 2>&1 | tail -n 3
