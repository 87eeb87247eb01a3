"""The layering rule, checked on the source: imports inside `ikbo_jax` only go downward.

Each package or module of `ikbo_jax` sits in one layer (README, "Architecture").
A module may import its own package and anything in a lower layer; an import
of a higher layer, or of another package of the same layer, fails this test,
as does any circle between modules. Function-local imports count as well.
The command lines answer `--help` before jax loads.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ikbo_jax"

# Lowest first. Packages of one layer are siblings and must not import each other.
LAYERS = (
    ("ikbo_jax._padding", "ikbo_jax.platform", "ikbo_jax._cli", "ikbo_jax._lazy"),
    ("ikbo_jax.kernels",),  # arrays and a config in: below the index, so it never sees one
    ("ikbo_jax.index",),
    ("ikbo_jax.two_level_index",),  # two levels, each a CandidateIndex
    ("ikbo_jax._validation", "ikbo_jax._dispatch"),
    ("ikbo_jax.ops",),
    ("ikbo_jax",),  # the package itself: the public ops (this entry holds no submodule)
    ("ikbo_jax.nn", "ikbo_jax.rewrite", "ikbo_jax.sharding"),
    ("ikbo_jax.models", "ikbo_jax.testing"),
    ("ikbo_jax.data",),
    ("ikbo_jax.training", "ikbo_jax.serving"),
    ("ikbo_jax.__main__", "ikbo_jax.demo"),
)


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
  path = ROOT.parent.joinpath(*name.split("."))
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: pathlib.Path) -> set[str]:
  """The `ikbo_jax` modules `path` imports (`from ikbo_jax import x` counts as `ikbo_jax.x`)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.split(".")[0] == "ikbo_jax")
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split(".")[0] != "ikbo_jax":
        continue
      for alias in node.names:
        child = f"{node.module}.{alias.name}"
        found.add(child if _is_module(child) else node.module)
  return found


def _graph() -> dict[str, set[str]]:
  return {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}


def _unit(module: str) -> tuple[int, str]:
  """`(layer, package)` of a module: the longest layer entry that contains it."""
  best = None
  for level, names in enumerate(LAYERS):
    for name in names:
      contains = module == name or (name != "ikbo_jax" and module.startswith(name + "."))
      if contains and (
          best is None or len(name) > len(best[1])):
        best = (level, name)
  if best is None:
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to the README)")
  return best


def test_every_import_goes_down_a_layer():
  upward = []
  for module, imported in sorted(_graph().items()):
    level, package = _unit(module)
    for target in sorted(imported):
      target_level, target_package = _unit(target)
      if target_package == package:
        continue
      if target_level >= level:
        upward.append(f"{module} -> {target} (layer {level} -> {target_level})")
  assert not upward, "imports that do not go down a layer:\n" + "\n".join(upward)


def test_no_circle_between_modules():
  graph = _graph()
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(module, path):
    state[module] = 1
    for target in sorted(graph.get(module, ())):
      if state.get(target) == 1:
        pytest.fail("import circle: " + " -> ".join(path[path.index(target):] + [target]))
      if state.get(target) is None:
        visit(target, path + [target])
    state[module] = 2

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])


def test_the_rule_sees_an_upward_import(tmp_path, monkeypatch):
  # A test that cannot fail is a defect: a kernel importing the ops layer must be caught.
  fake = tmp_path / "ikbo_jax"
  (fake / "kernels").mkdir(parents=True)
  (fake / "ops").mkdir()
  for package in (fake, fake / "kernels", fake / "ops"):
    (package / "__init__.py").write_text("")
  (fake / "kernels" / "k.py").write_text("from ikbo_jax.ops import o\n")
  (fake / "ops" / "o.py").write_text("from ikbo_jax.kernels import k\n")
  monkeypatch.setattr(__import__(__name__), "ROOT", fake)
  with pytest.raises(AssertionError, match="ikbo_jax.kernels.k -> ikbo_jax.ops.o"):
    test_every_import_goes_down_a_layer()
  with pytest.raises(pytest.fail.Exception, match="import circle"):
    test_no_circle_between_modules()


def test_benchmark_scripts_never_import_another_script():
  """A script (a file with a `__main__` block) imports helper modules of `benchmarks`, never a script."""
  folder = ROOT.parent / "benchmarks"
  is_script = lambda module: '__name__ == "__main__"' in (
      folder / f"{module.removeprefix('benchmarks.')}.py").read_text()
  crossing = []
  for path in sorted(folder.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
        targets = ({f"{node.module}.{a.name}" for a in node.names} if node.module == "benchmarks"
                   else {node.module})
        crossing += [f"{path.name} -> {t}" for t in targets if is_script(t)]
  assert not crossing, crossing
  assert is_script("benchmarks.ranking_system") and not is_script("benchmarks.common")


@pytest.mark.parametrize("module", ["ikbo_jax", "ikbo_jax.training", "ikbo_jax.serving",
                                    "ikbo_jax.serving.loadgen"])
def test_every_command_line_answers_help_before_jax_loads(module):
  """`--help` shows the real program name and defaults, and imports no jax (it took ~9 s)."""
  code = ("import runpy, sys\nsys.argv = ['x', '--help']\ntry:\n"
          f"  runpy.run_module({module!r}, run_name='__main__')\nexcept SystemExit:\n  pass\n"
          "print('jax loaded' if 'jax' in sys.modules else 'no jax')")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT.parent, timeout=60, check=True)
  assert f"usage: python -m {module}" in result.stdout
  assert "(default:" in result.stdout
  assert result.stdout.strip().endswith("no jax"), result.stdout[-300:]
