"""A server of several processes: one model process, N HTTP processes, one supervisor.

One Python process tops out at a few thousand requests a second, most of it
reading and decoding bodies, below what the device can score. So with
`--http-processes N` the supervisor (the command's own process, which never
loads jax's backend) opens the listening socket once and starts:

* the model process (`model_server`): the one model, its user-state cache and
  its batcher, on a Unix socket. Every user's requests meet the same cache and
  batches fill from every HTTP process, so neither the hit rate nor the batch
  size falls with N; and the device's memory holds one model.
* N HTTP processes, each a whole app (`http.create_app(model_process=...)`)
  accepting from the one shared listening socket, as gunicorn's workers do:
  the kernel hands each connection to whichever process accepts first, and a
  connection waiting in the accept queue is not lost when one process dies.
  They run jax on the CPU only (bodies are decoded and validated there).

Counters and histograms of all processes add up in prometheus-client's
multiprocess files, so a scrape of any HTTP process reports the whole server.
A process that dies is started again (one line in the log); one that dies more
than `MAX_RESTARTS` times a minute, or a model process that cannot start its
model (a checkpoint that does not verify), stops the server with exit status 1.
On SIGTERM or SIGINT the HTTP processes drain first (each answers its share of
the accept queue 503 and finishes what is in flight, `draining.py`), then the
model process stops (it ignores both signals, which a terminal or a service
manager may send the whole group, and stops on the supervisor's SIGUSR1). A
child whose supervisor is gone (killed) stops as on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait

from ikbo_jax.serving import frames

MAX_RESTARTS = 5  # in any minute, per role
LAUNCH_FAILED = 3  # the model process's exit status when the model cannot be served
STOP_MODEL = signal.SIGUSR1  # the supervisor's word to the model process


def _exit_with_parent(sig: int, parent: int) -> None:
  """Sends this process `sig` once its parent, the supervisor (pid `parent`, passed in: it
  may be gone before this process has imported its modules), is gone: no orphan keeps the
  port, the socket or the device."""

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os.kill(os.getpid(), sig)

  threading.Thread(target=watch, daemon=True, name="ikbo-parent-watch").start()


def run_model_process(args: argparse.Namespace, path: str, supervisor: int) -> None:
  """The model process's main: builds the model and serves it on `path`."""
  import uvloop  # the event loop uvicorn runs in the HTTP processes

  from ikbo_jax.serving import launch
  from ikbo_jax.serving.model_server import ModelServer

  # A terminal's Ctrl-C, or a service manager's SIGTERM, may reach every process of the
  # group: this one stops only when the supervisor says (SIGUSR1), after the HTTP processes
  # have drained, or when the supervisor is gone.
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
  _exit_with_parent(STOP_MODEL, supervisor)
  try:
    ranker = launch.load_ranker(args)
  except launch.LaunchError as e:
    print(f"model process: {e}", file=sys.stderr, flush=True)
    sys.exit(LAUNCH_FAILED)
  server = ModelServer(path, launch.model_builder(args, ranker), launch.batching(args),
                       stop_signal=STOP_MODEL)
  uvloop.run(server.serve())
  if server.failed:
    sys.exit(LAUNCH_FAILED)


def run_http_process(args: argparse.Namespace, listener: socket.socket, path: str,
                     supervisor: int) -> None:
  """An HTTP process's main: an app on the shared `listener` for the model process at `path`."""
  os.environ["JAX_PLATFORMS"] = "cpu"  # the device belongs to the model process
  from ikbo_jax.serving import launch

  _exit_with_parent(signal.SIGTERM, supervisor)
  launch.http_server(args, model_process=path).run(sockets=[listener])


class Supervisor:
  """Starts the processes, starts again those that die, and stops them in order."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    self._context = multiprocessing.get_context("spawn")  # no forked jax state, no forked locks
    self._stopping = False
    self._deaths = collections.defaultdict(collections.deque)  # role -> times of deaths

  def run(self) -> int:
    args = self.args
    try:
      self.listener = socket.create_server((args.host, args.port), backlog=args.backlog)
    except OSError as e:
      print(f"cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
      return 1
    metrics_dir = tempfile.mkdtemp(prefix="ikbo-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any child imports it
    self.path = frames.private_socket_path()
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda *_: setattr(self, "_stopping", True))
    try:
      self.model = self._start("model")
      self.http = [self._start("http") for _ in range(args.http_processes)]
      print(f"serving on http://{args.host}:{args.port}: HTTP processes "
            f"{[p.pid for p in self.http]}, model process {self.model.pid}", flush=True)
      return self._supervise()
    finally:
      self._stop()
      shutil.rmtree(metrics_dir, ignore_errors=True)
      shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

  def _start(self, role: str) -> multiprocessing.Process:
    if role == "model":
      target, process_args = run_model_process, (self.args, self.path, os.getpid())
    else:
      target, process_args = run_http_process, (self.args, self.listener, self.path,
                                                os.getpid())
    process = self._context.Process(target=target, args=process_args, name=f"ikbo-{role}")
    process.start()
    return process

  def _supervise(self) -> int:
    while not self._stopping:
      processes = [self.model, *self.http]
      wait([p.sentinel for p in processes], timeout=0.2)
      for i, process in enumerate(processes):
        if process.is_alive() or self._stopping:
          continue
        role = "model" if i == 0 else "http"
        if role == "model" and process.exitcode == LAUNCH_FAILED:
          print("the model process cannot serve this command line (above); stopping",
                file=sys.stderr, flush=True)
          return 1
        if self._too_many_deaths(role):
          print(f"the {role} process died {MAX_RESTARTS + 1} times within a minute; stopping",
                file=sys.stderr, flush=True)
          return 1
        replacement = self._start(role)
        if role == "model":
          self.model = replacement
        else:
          self.http[i - 1] = replacement
        print(f"the {role} process {process.pid} exited ({process.exitcode}); started "
              f"{replacement.pid}", file=sys.stderr, flush=True)
    return 0

  def _too_many_deaths(self, role: str) -> bool:
    deaths, now = self._deaths[role], time.monotonic()
    deaths.append(now)
    while deaths and deaths[0] < now - 60:
      deaths.popleft()
    return len(deaths) > MAX_RESTARTS

  def _stop(self) -> None:
    """HTTP processes drain (SIGTERM) while the model answers them; then the model stops."""
    # The port closes with the last HTTP process's copy of the socket, as with one process,
    # not later with this one's: a connection queued after the drain would be reset.
    self.listener.close()
    budget = self.args.drain_seconds + 10  # the accept queue's drain, then in-flight requests
    for group, sig in ((getattr(self, "http", []), signal.SIGTERM),
                       ([getattr(self, "model", None)], STOP_MODEL)):
      group = [p for p in group if p is not None and p.is_alive()]
      for process in group:
        with contextlib.suppress(ProcessLookupError):
          os.kill(process.pid, sig)
      deadline = time.monotonic() + budget
      for process in group:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
          process.kill()
          process.join()
