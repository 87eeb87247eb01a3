#!/usr/bin/env bash
# One device call: benchmarks and attention diagnostics first (the numbers that matter most if
# the call is cut short), then GPU tests, the demo and the linear-compression diagnostics. Results go to $OUT.
# Set IKBO_COMMIT (the device copy has no .git). STEPS picks what runs, by default
# "lc attention self_target tests demo diagnostics"; also "gate" (first in a session's first
# call, "sweep" in the next: every GPU test but the randomized sweep, then the rewrite's tests;
# GATE_WORKERS pytest processes share the GPU, since compiling dominates; each result line,
# and each failure in full, lands in $OUT as it happens; a test module whose packages the
# image lacks is reported and the others run: carry .whl for the serving ones), "sweep" (the
# randomized correctness sweep and the regression tests, failures in full), "soak" (tools/soak.py for SOAK_MINUTES),
# "system" (the ranking system benchmark and the main job at the benchmark preset),
# "serving" (checkpoint cost, the serving ladder three times, a profiler trace under load),
# "host_path" (variants of a call's transfer, execution and fetch), "host_stages" (each
# stage of a request in process: the call, lone requests, load), "command_buffers" (host_stages
# with XLA's command buffers as they are, off, and capturing custom calls too),
# "http_cost" (the HTTP server's CPU per request on this host, JSON and msgpack bodies),
# "cache" (the serving ladder once, then the user-state cache at two budgets),
# "cache_soak" (tools/cache_soak.py for SOAK_MINUTES),
# "overload" (the serving ladder REPEATS times, default 3, then 3x the sustained rates over HTTP:
# refusals, resets, p99; HTTP_PROCESSES for the server's), "http_front" (the sustained rate over
# HTTP with 1..8 HTTP processes feeding one model process), "http_replicas" (the same with
# N one-process servers holding a model each: the alternative front),
# "two_level" (benchmarks/two_level.py, then the two-level sweep cases),
# "profile" (every kernel of the ranker's inference and training step against its floor),
# "ranker_groups" (the ranker with a group level, IKBO vs standard build: inference and training),
# "rewrite" (original vs rewritten vs hand-written IKBO code), "fuzz" (the rewrite's property test
# on the host's CPUs), "rewrite_tests" (the rewrite's tests on the GPU),
# "backward" (the Mosaic GPU attention backward's GPU tests and regression tests, then the
# attention benchmark with its fwd_bwd/ and bwd/ rows; the step to run first once it compiles),
# "precision" (every attention path's gradients against float64 where the softmax is one-hot or
# peaked, and with delta taken from other sources: benchmarks/attention_precision.py),
# "attention_tests" (the attention GPU tests only), "attention_diagnostics" and "attention_ncu" (Nsight Compute). DIAG_ARGS go to the attention diagnostics. BENCH_ARGS=--no-sweeps shortens the lc step.
set -uo pipefail
OUT=${OUT:-/tmp/ikbo_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# One compilation cache for the processes of a call (the benchmark and the servers it starts).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
STEPS=${STEPS:-lc attention self_target tests demo diagnostics}
# The device image lacks the serving packages: carry their wheels as .whl (pip download
# --no-deps --only-binary=:all: --python-version 3.12 -d .whl starlette uvicorn uvloop httptools
# msgspec aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna).
if [ -d .whl ] && ! python3 -c "import starlette, uvicorn, uvloop, httptools, msgspec, aiohttp" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
has() { [[ " $STEPS " == *" $1 "* ]]; }
# Runs a command in its own process group and kills the group when the command ends: a
# pytest stopped by `timeout` otherwise leaves its xdist workers running into the next step.
grouped() {
  setsid "$@" &
  local pid=$! rc
  wait "$pid"; rc=$?
  kill -9 -- "-$pid" 2>/dev/null
  return "$rc"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > "$OUT/nvidia_smi.txt"
# Results are named by the card that measured them (h100, h200).
TAG=$(grep -o "H[0-9]00" "$OUT/nvidia_smi.txt" | head -n 1 | tr "[:upper:]" "[:lower:]")
TAG=${TAG:-gpu}
if has lc; then
  timeout "${BENCH_TIMEOUT:-240}" python3 -m benchmarks.linear_compression ${BENCH_ARGS:-} \
    --out "$OUT/linear_compression_${TAG}.json" > "$OUT/bench.log" 2>&1
  tail -n 13 "$OUT/bench.log"
fi
if has gate; then
  # Each worker's share of the card is capped: uncapped, 8 workers' autotuners ran it out of
  # memory (13 tests failed with OOM that pass alone). Tests marked big_memory need more than
  # a share: they run after, one at a time, with the whole card.
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=${GATE_MEM_FRACTION:-0.15} \
    IKBO_FAILURE_LOG="$OUT/gate_failures.log" \
    grouped timeout "${GATE_TIMEOUT:-490}" python3 -m pytest -p no:cacheprovider \
    -m "gpu and not big_memory" -rf --tb=line -n "${GATE_WORKERS:-6}" -v \
    --continue-on-collection-errors tests --ignore=tests/test_gpu_sweep.py 2>&1 \
    | tee "$OUT/gate.log" \
    | grep -E "FAILED|ERROR|passed|failed" | cut -c1-400 | tail -n 40
  XLA_PYTHON_CLIENT_PREALLOCATE=false IKBO_FAILURE_LOG="$OUT/gate_failures.log" \
    grouped timeout "${GATE_BIG_TIMEOUT:-200}" python3 -m pytest -p no:cacheprovider \
    -m "gpu and big_memory" -rf --tb=line -v --continue-on-collection-errors tests 2>&1 | tee "$OUT/gate_big_memory.log" \
    | grep -E "FAILED|ERROR|passed|failed" | cut -c1-400 | tail -n 10
fi
if has precision; then
  timeout "${PRECISION_TIMEOUT:-240}" python3 -m benchmarks.attention_precision \
    --out "$OUT/attention_precision_${TAG}.json" 2>&1 | grep -v Warning | cut -c1-2500
fi
if has backward; then
  timeout 300 python3 -m pytest -q -x -s tests/test_target_attention_mosaic.py tests/test_target_attention_backward.py \
    -m gpu -k "hopper or single_position or one_key or one_hot or bit_repeatable" 2>&1 \
    | tee "$OUT/gpu_backward_tests.log" | tail -n 30
  timeout 280 python3 -m benchmarks.target_attention --seq-lens 512 1024 2048 4096 8192 \
    --out "$OUT/target_attention_backward_${TAG}.json" > "$OUT/attention_bench.log" 2>&1
  tail -n 6 "$OUT/attention_bench.log" | cut -c1-1500
fi
if has attention; then
  timeout 200 python3 -m benchmarks.target_attention --out "$OUT/target_attention_${TAG}.json" \
    > "$OUT/attention_bench.log" 2>&1
  tail -n 6 "$OUT/attention_bench.log" | cut -c1-900
fi
if has self_target; then
  timeout 240 python3 -m benchmarks.self_target_attention \
    --out "$OUT/self_target_attention_${TAG}.json" > "$OUT/self_target_bench.log" 2>&1
  tail -n 4 "$OUT/self_target_bench.log" | cut -c1-1500
fi
if has attention_diagnostics; then
  # ptxas's report on every kernel compiled goes to the program's output: a WGMMA
  # serialization warning (C7513) costs ~1.5x, spills cost registers' worth of local memory.
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 240 \
    python3 -m benchmarks.attention_diagnostics ${DIAG_ARGS:-} \
    --out "$OUT/attention_diagnostics_${TAG}.json" > /tmp/attention_diagnostics.log 2>&1
  grep "^S [0-9]* {" /tmp/attention_diagnostics.log | cut -c1-1500
  echo "ptxas: $(grep -c "ptxas" /tmp/attention_diagnostics.log) log lines," \
    "$(grep -ci warning /tmp/attention_diagnostics.log) warnings"
  grep -i warning /tmp/attention_diagnostics.log | sort | uniq -c | cut -c1-300 | head -n 5
fi
if has attention_ncu; then
  # Nsight Compute on the target kernel at S=1024: stall reasons per SASS instruction.
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
  # ptxas's report (registers, spills) goes to the program's output, kept in /tmp.
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 300 "$NCU" --clock-control none --kernel-name regex:ikbo_target_attention \
    --launch-skip "${NCU_SKIP:-0}" --launch-count "${NCU_LAUNCHES:-1}" --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section InstructionStats --section SourceCounters \
    --section ComputeWorkloadAnalysis -f -o /tmp/attention_ncu \
    python3 -m benchmarks.attention_diagnostics --out /dev/null --once --seq-lens 1024 --configs default \
    > /tmp/attention_ncu.log 2>&1
  tail -n 3 /tmp/attention_ncu.log
  grep -i "spill\|registers" /tmp/attention_ncu.log | sort | uniq -c | head -n 6
  # Only the two exports come back: $OUT returns at most 8 files.
  "$NCU" -i /tmp/attention_ncu.ncu-rep --page details > "$OUT/ncu_details.txt" 2>&1
  "$NCU" -i /tmp/attention_ncu.ncu-rep --page source --csv --print-source sass \
    > "$OUT/ncu_sass.csv" 2>&1
  grep -E "Duration|Registers Per|Issued Ipc|Warp Cycles Per Issued" "$OUT/ncu_details.txt"
fi
if has tests; then
  timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -q -p no:cacheprovider tests -m gpu -rA 2>&1 \
    | tail -n 60 > "$OUT/gpu_tests.log"
  tail -n 4 "$OUT/gpu_tests.log"
fi
if has sweep; then
  # -s: the sweep prints each failure as it happens, so a run cut by its limit keeps them.
  IKBO_FAILURE_LOG="$OUT/sweep_failures.log" \
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -s -p no:cacheprovider -m gpu --tb=line -rf \
    tests/test_gpu_sweep.py tests/test_target_attention_backward.py \
    tests/test_attention_padding_and_nan.py 2>&1 | tee "$OUT/gpu_sweep.log" \
    | grep -E "FAIL |^FAILED|passed|failed" | cut -c1-400
fi
if has soak; then
  timeout $(( ${SOAK_MINUTES:-5} * 60 + 120 )) python3 tools/soak.py --minutes "${SOAK_MINUTES:-5}" \
    --out "$OUT/soak_${TAG}.json" 2>&1 | tail -n 20 | cut -c1-400
fi
if has system; then
  timeout "${SYSTEM_TIMEOUT:-420}" python3 -m benchmarks.ranking_system \
    --parts inference training serving --out "$OUT/ranking_system_${TAG}.json" 2>&1 | grep -v Warning | tee "$OUT/ranking_system.log" \
    | cut -c1-400 | tail -n 30
  timeout 240 python3 -m ikbo_jax --preset benchmark --steps 30 --requests 300 --qps 50 \
    --out "$OUT/main_job_${TAG}.json" 2>&1 | grep -v "Warning\|it/s\|step/s" | tail -n 8
fi
if has serving; then
  # In process: what checkpointing costs training, the serving ladder (call breakdown, device
  # time, single requests, sustained rates three times), then a profiler trace under load.
  # SERVING_PARTS="serving" leaves out the checkpoint cost, PROFILE_QPS=0 the profile,
  # REPEATS=0 the ladders (the calls' breakdown and the device-bound rate alone).
  timeout "${SERVING_TIMEOUT:-420}" python3 -m benchmarks.ranking_system \
    --parts ${SERVING_PARTS:-checkpoint serving} --repeats "${REPEATS:-3}" \
    --out "$OUT/ranking_system_serving_${TAG}.json" 2>&1 | grep -v Warning \
    | tee "$OUT/serving.log" | cut -c1-300 | tail -n 40
  if [ "${PROFILE_QPS:-2000}" != 0 ]; then
    timeout 150 python3 -m benchmarks.serving_profile --qps "${PROFILE_QPS:-2000}" \
      --out "$OUT/serving_profile_${TAG}.json" --trace-dir /tmp/serving_trace 2>&1 \
      | grep -v Warning | tail -n 4
    gzip -c /tmp/serving_trace/*.xplane.pb > "$OUT/serving_profile_${TAG}.xplane.pb.gz"
  fi
fi
if has http_cost; then
  # The HTTP server's own CPU per request on this host's cores, JSON and msgpack bodies.
  for type in json msgpack; do
    timeout 120 python3 -m benchmarks.http_server_cost --content-type "application/$type" \
      --out "$OUT/http_server_cost_${type}_${TAG}.json" 2>&1 | tail -n 1
  done
fi
if has host_path; then
  # Variants of one call's transfer, execution and fetch (benchmarks/host_path.py).
  timeout 200 python3 -m benchmarks.host_path --out "$OUT/host_path_${TAG}.json" 2>&1 \
    | grep -v Warning | tail -n 3 | cut -c1-600
fi
if has cache; then
  # The user-state cache: its GPU tests, the uncached builds' ladder once, then the cached
  # build at two budgets on the same Zipf trace, and the user / candidate sides' device times.
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_user_cache.py \
    tests/test_models.py 2>&1 | tail -n 15 | tee "$OUT/cache_gpu_tests.log"
  timeout "${CACHE_TIMEOUT:-540}" python3 -m benchmarks.ranking_system --parts serving cache \
    --repeats 1 --out "$OUT/ranking_system_cache_${TAG}.json" 2>&1 | grep -v Warning \
    | tee "$OUT/cache.log" | cut -c1-300 | tail -n 30
fi
if has cache_soak; then
  # Cached scores against the uncached build for SOAK_MINUTES, evicting all the time.
  timeout $(( ${SOAK_MINUTES:-5} * 60 + 240 )) python3 tools/cache_soak.py \
    --minutes "${SOAK_MINUTES:-5}" --out "$OUT/cache_soak_${TAG}.json" 2>&1 | tail -n 20 | cut -c1-300
fi
if has overload; then
  # The serving ladder (call breakdown, sustained rates), then 3x those rates over HTTP for
  # OVERLOAD_SECONDS per build from client processes.
  # SUSTAINED="IKBO STANDARD" (rates from an earlier serving run) skips the ladder.
  parts="serving overload"; [ -n "${SUSTAINED:-}" ] && parts="overload"
  timeout "${OVERLOAD_TIMEOUT:-540}" python3 -m benchmarks.ranking_system \
    ${SUSTAINED:+--sustained $SUSTAINED} --parts $parts \
    --repeats "${REPEATS:-3}" --client-processes "${CLIENT_PROCESSES:-8}" \
    --http-processes "${HTTP_PROCESSES:-1}" --overload-seconds "${OVERLOAD_SECONDS:-60}" --out "$OUT/ranking_system_overload_${TAG}.json" \
    2>&1 | grep -v Warning | tee "$OUT/overload.log" | cut -c1-400 | tail -n 12
fi
if has host_stages; then
  # Where a request's time goes in process: the model's call stages, lone requests and
  # load through the batcher.
  # HOST_STAGES_ARGS add options; RESULT_SUFFIX names a variant's file (with XLA_FLAGS, say).
  timeout "${HOST_STAGES_TIMEOUT:-240}" python3 -m benchmarks.host_stages ${HOST_STAGES_ARGS:-} \
    --out "$OUT/host_stages_${TAG}${RESULT_SUFFIX:-}.json" 2>&1 | grep -v Warning | cut -c1-700 \
    | tail -n 14
fi
if has command_buffers; then
  # The call's launch cost with XLA's command buffers (CUDA graphs) as they are, off, and
  # capturing every kind of thunk they can (custom calls: the Pallas kernels) from one
  # thunk up; each variant compiles into a cache of its own.
  for variant in "default|" "off|--xla_gpu_enable_command_buffer=" \
      "all|--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"; do
    name=${variant%%|*}
    XLA_FLAGS="${variant#*|}" JAX_COMPILATION_CACHE_DIR="/tmp/jax_cache_cb_$name" \
      timeout "${HOST_STAGES_TIMEOUT:-170}" python3 -m benchmarks.host_stages \
      ${HOST_STAGES_ARGS:---rates 4000 8000 --lone 200} \
      --out "$OUT/host_stages_${TAG}_command_buffer_${name}.json" 2>&1 | grep -v Warning \
      | cut -c1-400 | tail -n 6
  done
fi
if has http_front; then
  # The sustained rate over HTTP with 1, 2, 4 and 8 HTTP processes feeding one model process
  # (HTTP_FRONT_PROCESSES to choose), each run written as it ends; HTTP_FRONT_ARGS adds
  # options (--server-timing: every answer's stages).
  timeout "${HTTP_FRONT_TIMEOUT:-560}" python3 -m benchmarks.http_front ${HTTP_FRONT_ARGS:-} \
    --http-processes ${HTTP_FRONT_PROCESSES:-1 2 4 8} --out "$OUT/http_front_${TAG}.json" 2>&1 \
    | grep -v Warning | cut -c1-300 | tail -n 30
fi
if has http_replicas; then
  # The front it was chosen over: N one-process servers with a model each (HTTP_REPLICAS).
  timeout "${HTTP_FRONT_TIMEOUT:-560}" python3 -m benchmarks.http_front --replicas ${HTTP_FRONT_ARGS:-} \
    --http-processes ${HTTP_REPLICAS:-2 4 8} --out "$OUT/http_replicas_${TAG}.json" 2>&1 \
    | grep -v Warning | cut -c1-300 | tail -n 30
fi
if has two_level; then
  # Two levels of sharing: the benchmark at B = 2048 (the target point first, each point
  # written as it is measured, TWO_LEVEL_POINTS="G,U ..." to choose, TWO_LEVEL_ARGS=--forward-only
  # for the whole grid without the backwards), then the sweep's
  # two-level cases on the kernels.
  grouped timeout "${TWO_LEVEL_TIMEOUT:-300}" python3 -m benchmarks.two_level ${TWO_LEVEL_ARGS:-} \
    ${TWO_LEVEL_POINTS:+--points $TWO_LEVEL_POINTS} --out "$OUT/two_level_${TAG}.json" 2>&1 \
    | grep -v Warning | tee "$OUT/two_level.log" | cut -c1-400 | tail -n 30
  IKBO_FAILURE_LOG="$OUT/two_level_failures.log" grouped timeout "${TWO_LEVEL_TEST_TIMEOUT:-240}" \
    python3 -m pytest -q -s -p no:cacheprovider -m gpu --tb=line tests/test_gpu_sweep.py \
    tests/test_two_level.py tests/test_two_level_attention.py -k two_level 2>&1 \
    | tee "$OUT/two_level_tests.log" | grep -E "FAIL |^FAILED|passed|failed" | cut -c1-400
fi
if has profile; then
  # Every kernel of the ranker's inference and training step with its part, phase, kind and
  # floor (command buffers off: a CUDA graph's kernels lose the instruction that names them),
  # then both timed as they run by default, for the whole.
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache_cb_off \
    timeout "${PROFILE_TIMEOUT:-240}" python3 -m benchmarks.ranker_profile ${PROFILE_ARGS:-} \
    --hlo-dir "$OUT" --out "$OUT/ranker_profile_${TAG}.json" 2>&1 | grep -v Warning | cut -c1-300 | tail -n 32
  timeout 200 python3 -m benchmarks.ranking_system --parts inference training --sizes 1024 \
    --ratios 70 --out "$OUT/ranking_system_profiled_${TAG}.json" 2>&1 | grep -v Warning \
    | cut -c1-400 | tail -n 3
fi
if has ranker_groups; then
  timeout "${GROUPS_TIMEOUT:-300}" python3 -m benchmarks.ranking_system --parts inference training \
    --items-per-group "${ITEMS_PER_GROUP:-8}" --sizes 1024 4096 --ratios 70 500 \
    --out "$OUT/ranking_groups_${TAG}.json" 2>&1 | grep -v Warning | cut -c1-400 | tail -n 8
fi
if has rewrite; then
  # With each program's compiled HLO: where a share is short, which kernels differ.
  timeout 300 python3 -m benchmarks.rewrite --hlo-dir /tmp/rewrite_hlo \
    --out "$OUT/rewrite_${TAG}.json" 2>&1 \
    | grep -v Warning | cut -c1-400 | tail -n 8
  # One archive: a call brings back only a few files.
  tar -czf "$OUT/rewrite_hlo_${TAG}.tar.gz" -C /tmp rewrite_hlo
fi
if has fuzz; then
  # The rewrite's property test, long profile, on the host's CPU cores (FUZZ_MINUTES), with
  # the CPU compiler's optimizations off (both sides alike): about 2x the programs a minute.
  XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" \
    JAX_PLATFORMS=cpu timeout $(( ${FUZZ_MINUTES:-4} * 60 + 90 )) python3 tools/rewrite_fuzz.py \
    --seeds "${FUZZ_SEEDS:-0:400}" --per-seed 50 --processes "${FUZZ_PROCESSES:-14}" \
    --minutes "${FUZZ_MINUTES:-4}" --out "$OUT/rewrite_fuzz_${TAG}_host.json" 2>&1 | tail -n 3
fi
if has rewrite_tests; then
  # The rewrite's tests with the GPU's kernels behind the ops it emits.
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q \
    -p no:cacheprovider tests/test_rewrite.py tests/test_rewrite_soundness.py \
    tests/test_rewrite_reach.py tests/test_rewrite_properties.py 2>&1 | tail -n 30 \
    > "$OUT/gpu_rewrite_tests.log"
  tail -n 4 "$OUT/gpu_rewrite_tests.log"
fi
if has attention_tests; then
  timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
    tests/test_target_attention.py tests/test_target_attention_mosaic.py \
    tests/test_self_target_attention.py 2>&1 | tail -n 30 > "$OUT/gpu_tests_attention.log"
  tail -n 4 "$OUT/gpu_tests_attention.log"
fi
if has demo; then
  timeout 60 python3 -m ikbo_jax.demo > "$OUT/demo.log" 2>&1; tail -n 5 "$OUT/demo.log"
fi
if has diagnostics; then
  timeout 60 python3 -m benchmarks.lce_diagnostics --out "$OUT/lce_diagnostics.json" 2>&1 \
    | tail -n 3
fi
