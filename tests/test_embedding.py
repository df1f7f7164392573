"""docs/embedding.md and the README's embedding example are true: their ```python blocks run, in order, in one fresh
process each (so ``import fp8jax`` there is a user's first import, with XLA's defaults), and every assertion they make
holds."""

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run_blocks(doc: pathlib.Path, at_least: int) -> str:
  blocks = re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.M | re.S)
  assert len(blocks) >= at_least, f"expected examples in {doc}, found {len(blocks)} python blocks"
  program = "".join(f"# ---- block {i} ----\n" + b for i, b in enumerate(blocks))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  env.pop("XLA_FLAGS", None)
  res = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600, env=env,
                       cwd=str(REPO))
  assert res.returncode == 0, f"{doc.name} failed:\n{res.stderr[-4000:]}"
  return res.stdout


def test_embedding_page_examples_run():
  out = _run_blocks(REPO / "docs" / "embedding.md", 6)
  assert "xla_allow_excess_precision" in out  # the settings block printed what it promises to show


def test_readme_example_runs():
  _run_blocks(REPO / "README.md", 1)
