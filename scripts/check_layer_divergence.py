"""Where do the sampler's decode rows part from the trainer's? Block by block, layer by layer (issue 15's hunt).

  PYTHONPATH=. python3 scripts/check_layer_divergence.py [--dim 1024 --layers 4 --vocab 32768 --rows 64 --len 96]

``fp8jax.diagnostics.one_engine.block_divergence`` for each recipe (read its module docstring): the trainer's forward
and the sampler's prefill + decode path run the same random tokens; for every block's output (norms, attention, MLP,
residual stream entering each norm, final norm, the head's log-prob) the fraction of decode rows bitwise equal to the
training rows and the max |difference|. The first tensor that differs is where the engines part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

from fp8jax import backends  # noqa: E402
from fp8jax.diagnostics import one_engine  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402


def main():
  ap = one_engine.add_model_args(argparse.ArgumentParser())
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--len", type=int, default=48)
  ap.add_argument("--recipes", default="fp8,fp8+kv,bf16")
  a = ap.parse_args()
  cfg = one_engine.model_config(a.dim, a.layers, a.vocab)
  recipes = one_engine.promised_recipes(a.quantize_lm_head)
  result = {**provenance(), "args": vars(a), "recipes": {}}
  for name in a.recipes.split(","):
    result["recipes"][name] = one_engine.block_divergence(cfg, recipes[name], a.rows, a.len)
  print(f"device: {result['device']}; backends: {backends.backend_report()}")
  for name, rows in result["recipes"].items():
    first = next((r["tensor"] for r in rows if r["rows_bitwise"] < 1), None)
    print(f"\n{name}: first tensor that differs: {first}")
    print(f"{'tensor':18s} {'rows bitwise':>13s} {'max|diff|':>10s}")
    for r in rows:
      print(f"{r['tensor']:18s} {r['rows_bitwise']:13.4f} {r['max_abs_diff']:10.2e}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
