"""Document sections generated from `benchmarks/results/`: the command that writes or checks one."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable


def between(text: str, start: str, end: str, section: str) -> str:
  """`text` with everything from marker `start` to marker `end` replaced by `section`."""
  if start not in text or end not in text:
    raise ValueError(f"the document has no markers {start} ... {end}")
  return text[:text.index(start)] + section + text[text.index(end) + len(end):]


def main(argv, *, prog: str, description: str, path: pathlib.Path,
         render: Callable[[str], str]) -> int:
  """`--write` rewrites `path` as `render(text)`; `--check` returns 1 if that would change it."""
  parser = argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  mode = parser.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true", help="regenerate the section in place")
  mode.add_argument("--check", action="store_true", help="exit 1 if the section is stale")
  args = parser.parse_args(argv)
  text = path.read_text()
  fresh = render(text)
  if args.write:
    path.write_text(fresh)
    return 0
  if fresh != text:
    print(f"{path.name} is stale: run {prog} --write")
    return 1
  return 0
