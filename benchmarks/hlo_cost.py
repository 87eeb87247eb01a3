"""What each instruction of a compiled XLA program is and moves, read from its HLO text.

A profiler names the instruction behind each kernel (its `hlo_op`); this module
says what that instruction is: its opcode, the `op_name` JAX gave it (the
named scopes and transformations it was traced under), the bytes its operands
and results occupy, and the FLOPs of the matrix products it runs (a dot, a
cuBLAS GEMM custom call, or the dots a fusion calls). Those give a kernel's
floor: the bytes at the copy bandwidth or the FLOPs at the matmul rate.

Only what the text states is used; an instruction this module cannot read is
kept with what it could read (bytes of the shapes it found, no FLOPs).
"""

from __future__ import annotations

import dataclasses
import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[sfu]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_LHS_CONTRACTING = (re.compile(r"lhs_contracting_dims=\{([\d,]*)\}"),
                    re.compile(r'"lhs_contracting_dimensions":\[([\d",]*)\]'))


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: what a kernel named after it computes and moves.

  Attributes:
    name: its name in the module (a profiler's `hlo_op`).
    opcode: `fusion`, `custom-call`, `copy`, `scatter`, ...
    op_name: the name JAX traced it under (`jit(f)/transpose(jvp(tower))/dot_general`).
    result_bytes: bytes of its result (every element of a tuple).
    operand_bytes: bytes of its operands.
    flops: FLOPs of its matrix products (0 where it runs none).
    target: a custom call's target (`__cublas$gemm`, a Pallas kernel's), else "".
    fusion_kind: a fusion's kind (`kLoop`, `kInput`, `kCustom`, ...), else "".
  """

  name: str
  opcode: str
  op_name: str
  result_bytes: int
  operand_bytes: int
  flops: float
  target: str = ""
  fusion_kind: str = ""

  @property
  def bytes(self) -> int:
    """Bytes read and written, each operand and result once: the fewest it can move."""
    return self.result_bytes + self.operand_bytes


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY.findall(text)]


def _nbytes(shapes) -> int:
  return sum(_itemsize(dtype) * math.prod(dims) for dtype, dims in shapes)


def _itemsize(dtype: str) -> int:
  """Bytes of one element: `bf16` 2, `s32` 4, `pred` 1, sub-byte types 1 (their fewest)."""
  if dtype in ("pred", "bf16"):
    return {"pred": 1, "bf16": 2}[dtype]
  bits = int(re.match(r"[a-z]+(\d+)", dtype).group(1))
  return max(1, bits // 8)


def _split_attributes(rest: str) -> tuple[str, str]:
  """`(operands, attributes)` of the text after an opcode's opening parenthesis."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ""


@dataclasses.dataclass
class _Parsed:
  opcode: str
  result: list
  operands: list[str]
  attributes: str
  calls: list[str]


def parse(hlo_text: str) -> dict[str, Instruction]:
  """Every instruction of a compiled module's text (`compiled.as_text()`), by name."""
  parsed, computations, roots, current = {}, {}, {}, None
  for line in hlo_text.splitlines():
    if (match := _COMPUTATION.match(line)) and "=" not in line.split("(")[0]:
      computation, current = match.group(1), computations.setdefault(match.group(1), [])
      continue
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, result, opcode, rest = match.groups()
    operands, attributes = _split_attributes(rest)
    parsed[name] = _Parsed(opcode, _shapes(result), _OPERAND.findall(operands), attributes,
                           _CALLS.findall(attributes))
    if current is not None:
      current.append(name)
      if line.lstrip().startswith("ROOT "):
        roots[computation] = name
  # A GEMM custom call's result is `(product, workspace)`: the workspace is scratch, not traffic.
  result_bytes = {name: _nbytes(p.result[:1] if _is_gemm(p) else p.result)
                  for name, p in parsed.items()}

  def flops(name: str, seen: frozenset = frozenset()) -> float:
    p = parsed[name]
    if p.opcode == "dot" or _is_gemm(p):
      return _dot_flops(p, parsed)
    return sum(flops(inner, seen | {called}) for called in p.calls if called not in seen
               for inner in computations.get(called, ()))

  def op_name(name: str, depth: int = 0) -> str:
    # An instruction XLA made may carry no metadata of its own: then its root's (what a
    # fusion computes) or its operands' (what it was made from) stand for it.
    p = parsed[name]
    if match := _OP_NAME.search(p.attributes):
      return match.group(1)
    if depth > 8:
      return ""
    inherited = ([roots[c] for c in p.calls if c in roots]
                 + [o for o in p.operands if o in parsed])
    return next((found for n in inherited if (found := op_name(n, depth + 1))), "")

  instructions = {}
  for name, p in parsed.items():
    target = _CUSTOM_TARGET.search(p.attributes)
    kind = re.search(r"kind=(k\w+)", p.attributes)
    instructions[name] = Instruction(
        name=name, opcode=p.opcode, op_name=op_name(name),
        result_bytes=result_bytes[name],
        operand_bytes=sum(result_bytes.get(o, 0) for o in p.operands),
        flops=flops(name), target=target.group(1) if target else "",
        fusion_kind=kind.group(1) if kind else "")
  return instructions


def _is_gemm(p: _Parsed) -> bool:
  target = _CUSTOM_TARGET.search(p.attributes)
  return bool(p.opcode == "custom-call" and target and re.search("gemm|matmul", target.group(1)))


def _dot_flops(p: _Parsed, parsed: dict[str, _Parsed]) -> float:
  """2 * (result elements) * (contracted size) of a dot or GEMM custom call."""
  if not p.result or not p.operands or p.operands[0] not in parsed:
    return 0.0
  lhs = parsed[p.operands[0]].result
  for pattern in _LHS_CONTRACTING:
    if (match := pattern.search(p.attributes)) and lhs:
      dims = [int(d) for d in match.group(1).replace('"', "").split(",") if d]
      contracted = math.prod(lhs[0][1][d] for d in dims if d < len(lhs[0][1]))
      return 2.0 * math.prod(p.result[0][1]) * contracted
  return 0.0
