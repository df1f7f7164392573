"""The import graph points one way: ``pallas_kernels`` (kernels beside their references) imports nothing from
``fp8jax``; ``pallas_kernels.core`` (block size, E4M3 rounding, fixed-order sums) imports nothing from the project;
nothing outside ``fp8jax.diagnostics`` (checks and harnesses that measure the library) imports it; no module-level
import circle anywhere in the two packages. Read from the source with ``ast`` (nothing imported),
so a lazy import inside a function counts as an arrow too for the upward check."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("fp8jax", "pallas_kernels")
DIAGNOSTICS = "fp8jax.diagnostics"


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for pkg in PACKAGES:
    for path in (ROOT / pkg).rglob("*.py"):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      mods[".".join(parts)] = path
  return mods


def _targets(node, module: str, is_package: bool, mods) -> set[str]:
  """The project modules an import statement runs: ``from a import b`` is ``a.b`` when that is a module, else ``a``."""
  if isinstance(node, ast.Import):
    return {a.name for a in node.names if a.name in mods}
  if node.level:
    here = module.split(".") if is_package else module.split(".")[:-1]
    base = here[: len(here) - node.level + 1]
    base = ".".join(base + ([node.module] if node.module else []))
  else:
    base = node.module or ""
  out = set()
  for a in node.names:
    full = f"{base}.{a.name}"
    out.add(full if full in mods else base)
  return {m for m in out if m in mods}


def _graph(top_level_only: bool) -> dict[str, set[str]]:
  mods = _modules()
  graph = {}
  for name, path in mods.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    deps = set()
    for node in nodes:
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        deps |= _targets(node, name, path.name == "__init__.py", mods)
    deps.discard(name)
    graph[name] = deps
  return graph


def _cycles(graph) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  counter = 0
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter
    counter += 1
    stack.append(root)
    on_stack.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = counter
          counter += 1
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph[w]))))
        elif w in on_stack:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on_stack.discard(w)
          comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def test_cycle_finder_finds_a_planted_circle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module_level", "with_lazy_imports"])
def test_kernels_import_nothing_from_the_library(top_level_only):
  graph = _graph(top_level_only)
  upward = sorted((a, b) for a, deps in graph.items() if a.startswith("pallas_kernels")
                  for b in deps if b.split(".")[0] == "fp8jax")
  assert not upward, f"pallas_kernels must not import fp8jax (move the helper to pallas_kernels/core.py): {upward}"
  core = graph["pallas_kernels.core"]
  assert not core, f"pallas_kernels/core.py is the dependency-free base, but imports {sorted(core)}"


def _in_diagnostics(module: str) -> bool:
  return module == DIAGNOSTICS or module.startswith(DIAGNOSTICS + ".")


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module_level", "with_lazy_imports"])
def test_the_library_never_imports_its_diagnostics(top_level_only):
  graph = _graph(top_level_only)
  assert DIAGNOSTICS in graph, f"{DIAGNOSTICS} not found: is the source layout as expected?"
  inward = sorted((a, b) for a, deps in graph.items() if not _in_diagnostics(a) for b in deps if _in_diagnostics(b))
  assert not inward, f"{DIAGNOSTICS} measures the library, which must not import it (scripts/ and tests/ may): {inward}"


def test_no_module_level_import_circles():
  graph = _graph(top_level_only=True)
  assert len(graph) > 40 and graph["fp8jax.ops"], "the import walk found too little: is the source layout as expected?"
  assert _cycles(graph) == [], "module-level import circles (each a strongly connected set of modules)"
