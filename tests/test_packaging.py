"""pyproject.toml declares what fp8jax imports (a fresh install must not fail on an undeclared import)."""

import ast
import importlib.metadata
import os
import re
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported only where the docs say to install it yourself (fp8jax/rl/data.py: parquet files need pyarrow).
OPTIONAL = {"pyarrow"}
# Imported only by helpers for tests and demos (fp8jax.hf.make_tiny_hf_dir): the "test" extra must declare them.
TEST_ONLY = {"torch", "transformers"}


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _declared():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    proj = tomllib.load(f)["project"]
  name = lambda req: _norm(re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0])  # noqa: E731
  return {name(r) for r in proj["dependencies"]}, {name(r) for r in proj["optional-dependencies"]["test"]}


def _imported_top_level_modules():
  mods = set()
  for pkg in ("fp8jax", "pallas_kernels"):
    for root, _, files in os.walk(os.path.join(REPO, pkg)):
      for fname in files:
        if fname.endswith(".py"):
          with open(os.path.join(root, fname)) as f:
            tree = ast.parse(f.read())
          for node in ast.walk(tree):
            if isinstance(node, ast.Import):
              mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
              mods.add(node.module.split(".")[0])
  return mods - set(sys.stdlib_module_names) - {"fp8jax", "pallas_kernels", "configs"}


def test_every_import_is_a_declared_dependency():
  core, test = _declared()
  dists = importlib.metadata.packages_distributions()
  for mod in sorted(_imported_top_level_modules() - OPTIONAL):
    names = {_norm(d) for d in dists.get(mod, [mod])}
    where = test if mod in TEST_ONLY else core
    assert names & where, f"fp8jax imports {mod!r} (distribution {sorted(names)}) but pyproject.toml does not declare it"
  assert "jinja2" in core  # chat templates: hf.Tokenizer, used by task="math" at run time
