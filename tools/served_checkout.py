"""The command line's server from a checkout, started for a hostile-client measurement.

`tools/idle_connections.py` and `tools/sigterm_under_load.py` measure a checkout's real
server (`python -m ikbo_jax.serving`, small preset, random weights), that one or another
(`--src`, to measure the code before a change in the same run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx


def start(src: str, port: int) -> subprocess.Popen:
  """The server of checkout `src` on loopback `port`, returned once it reports ready."""
  env = dict(os.environ, PYTHONPATH=os.path.abspath(src), JAX_PLATFORMS="cpu")
  server = subprocess.Popen([sys.executable, "-m", "ikbo_jax.serving", "--port", str(port)],
                            cwd=src, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
    deadline = time.time() + 300
    while time.time() < deadline:
      try:
        if client.get("/health/ready").status_code == 200:
          return server
      except httpx.TransportError:
        pass
      time.sleep(0.5)
  server.terminate()
  raise RuntimeError(f"the server of {src} was not ready within 300 s")
