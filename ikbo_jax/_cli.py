"""The command lines' shared parser: the real program name, the whole docstring, defaults, --version."""

from __future__ import annotations

import argparse


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Keeps the docstring's layout and appends each option's default to its help."""


def parser(module: str, doc: str, version: str) -> argparse.ArgumentParser:
  """An `ArgumentParser` for `python -m module`, described by its module docstring."""
  result = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=_Formatter)
  result.add_argument("--version", action="version", version=f"ikbo_jax {version}")
  return result
