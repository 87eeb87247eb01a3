"""Timing, ceilings and result files shared by the benchmark scripts."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp


def median_ms(fn, *args, iterations: int = 30) -> tuple[float, str]:
  """Median device time of `fn(*args)` in ms: CUPTI kernel time where available, else wall clock."""
  jax.block_until_ready(fn(*args))
  if jax.default_backend() == "gpu":
    from jax.experimental.mosaic.gpu import profiler
    try:
      _, times = profiler.measure(fn, iterations=iterations)(*args)
      if times:
        return statistics.median(times), "cupti"
    except Exception as e:  # noqa: BLE001 - every failure is reported and measured around
      # One call's kernels can finish interleaved with the next call's (a program with
      # concurrent streams): then each call is measured alone, which cannot interleave. Its
      # kernels' summed time bounds the call's device time from above where streams overlap.
      print(f"cupti timing over {iterations} calls failed ({e}); measuring one call at a time")
      try:
        times = [profiler.measure(fn)(*args)[1] for _ in range(iterations)]
        if all(times):
          return statistics.median(times), "cupti_per_call"
      except Exception as e:  # CUPTI unavailable: fall back, and say so in the result.
        print(f"cupti timing failed ({type(e).__name__}: {e}); using wall clock")
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times), "wall"


def wall_median_ms(step, iterations: int) -> float:
  """Median wall-clock ms of `step()` (host work included), after one call off the clock."""
  step()
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def measure_ceilings() -> dict:
  """bf16 matmul rate and device-to-device copy bandwidth, measured on this device."""
  n = 8192 if jax.default_backend() == "gpu" else 512
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm_ms, _ = median_ms(jax.jit(jnp.matmul), a, b, iterations=10)
  x = jax.random.normal(jax.random.key(2), (1 << (28 if n == 8192 else 20),), jnp.float32)
  copy_ms, _ = median_ms(jax.jit(lambda x: x * 2), x, iterations=10)
  return dict(matmul_tflops=2 * n ** 3 / mm_ms / 1e9, copy_tbps=2 * x.nbytes / copy_ms / 1e9)


def rates(ms: float, flops: float, nbytes: float, ceilings: dict) -> dict:
  """TFLOP/s, TB/s and the fraction of the roofline reached in `ms`.

  The roofline time is the larger of `flops` at the measured matmul rate and
  `nbytes` (the fewest bytes the problem must move) at the measured copy bandwidth.
  """
  roofline_ms = max(flops / (ceilings["matmul_tflops"] * 1e9),
                    nbytes / (ceilings["copy_tbps"] * 1e9))
  return dict(tflops=flops / ms / 1e9, tbps=nbytes / ms / 1e9, roofline_fraction=roofline_ms / ms)


def metadata() -> dict:
  commit = os.environ.get("IKBO_COMMIT")  # the device machine's copy has no .git
  try:
    commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                      text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = "unknown"
  # XLA's flags change what a number means (command buffers, say): recorded where set.
  flags = {"xla_flags": os.environ["XLA_FLAGS"]} if os.environ.get("XLA_FLAGS") else {}
  return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              commit=commit, device=jax.devices()[0].device_kind,
              jax_version=jax.__version__, backend=jax.default_backend(), host=host(), **flags)


def host() -> dict:
  """The host's CPUs, kernel and the cost of a system call pair on it.

  The serving numbers are the host's as much as the device's: two machines lent as the same
  kind have held 12,000 and 5,000 requests a second on one tree. A sandboxing kernel (gVisor
  reports release 4.4.0) makes every socket call dearer, which the loopback round trip shows.
  """
  model = "unknown"
  with contextlib.suppress(OSError):
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), model)
  return dict(cpus=os.cpu_count(), cpu_model=model, kernel=platform.release(),
              socket_round_trip_us=_socket_round_trip_us())


def _socket_round_trip_us(trips: int = 2000) -> float:
  """One byte sent and read back on a Unix socket pair (two system calls), in microseconds:
  the median of five runs."""
  a, b = socket.socketpair()
  with a, b:
    runs = []
    for _ in range(5):
      start = time.perf_counter()
      for _ in range(trips):
        a.send(b"x")
        b.recv(1)
      runs.append(1e6 * (time.perf_counter() - start) / trips)
  return statistics.median(runs)


def write_json(path: str, payload: dict) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=1)


def process_tree_cpu_seconds(pids) -> float:
  """User + system CPU seconds of the processes `pids` and all their descendants (Linux /proc).

  A process that ended between the walk and the read counts as nothing.
  """
  ticks, seen, todo = 0, set(), list(pids)
  hertz = os.sysconf("SC_CLK_TCK")
  while todo:
    pid = todo.pop()
    if pid in seen:
      continue
    seen.add(pid)
    try:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
      for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
          todo.extend(int(child) for child in f.read().split())
    except (FileNotFoundError, ProcessLookupError):
      continue
  return ticks / hertz
