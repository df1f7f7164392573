"""Is the embedding table's gradient the same bits on every call, and what does it cost?

  python scripts/check_grad_repeat.py [--repeats=10] [--shapes=smollm2,llama8b] [--out=FILE.json]

The gradient of a token-embedding gather is a sum of each position's cotangent into its token's row. Three ways to
compute it, each jitted once and called --repeats times on the same inputs (FP32 table, BF16 cotangents, token ids
drawn Zipf-like, so common ids repeat thousands of times), at SmolLM2-135M's shape (vocab 49,152 x 576, 16 x 640
tokens) and Llama-3.1-8B's (128,256 x 4,096, 4 x 4,096 tokens):
  * ``scatter_add``: ``zeros.at[ids].add(rows)``, what a gather's transpose is in JAX (XLA:GPU: atomic adds);
  * ``scatter_add_expander``: the same with XLA's option xla_gpu_enable_scatter_determinism_expander (a sort and a
    prefix scan inside XLA);
  * ``fp8jax``: ``pallas_kernels.core.segment_sum``, what ``fp8jax.model.layers.embed``'s backward runs (sort,
    segmented scan, one write per id).
Printed per way and shape: how many calls gave the first call's bits, the time per call, and the largest error
against a float64 sum relative to the largest entry. A way that is not repeatable makes two training runs of one
command diverge after their first step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402

fp8jax.configure_xla()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import core  # noqa: E402

SHAPES = {"smollm2": (49152, 576, (16, 640)), "llama8b": (128256, 4096, (4, 4096))}


def ways(v: int):
  def scatter_add(tok, g):
    return jnp.zeros((v, g.shape[-1]), jnp.float32).at[tok.reshape(-1)].add(
        g.reshape(-1, g.shape[-1]).astype(jnp.float32))

  def ours(tok, g):
    return core.segment_sum(tok.reshape(-1), g.reshape(-1, g.shape[-1]), v, jnp.float32)

  return {"scatter_add": (scatter_add, {}),
          "scatter_add_expander": (scatter_add, {"xla_gpu_enable_scatter_determinism_expander": True}),
          "fp8jax": (ours, {})}


def measure(name: str, repeats: int) -> dict:
  v, d, bt = SHAPES[name]
  rng = np.random.default_rng(0)
  tok = jnp.asarray(np.minimum(rng.zipf(1.3, bt) - 1, v - 1).astype(np.int32))
  g = jnp.asarray(rng.standard_normal((*bt, d), np.float32)).astype(jnp.bfloat16)
  want = np.zeros((v, d))
  np.add.at(want, np.asarray(tok).reshape(-1), np.asarray(g.astype(jnp.float32), np.float64).reshape(-1, d))
  scale = np.abs(want).max()
  out = {}
  for way, (fn, opts) in ways(v).items():
    f = jax.jit(fn).lower(tok, g).compile(compiler_options=dict(fp8jax.COMPILER_OPTIONS, **opts))
    first = np.asarray(f(tok, g))
    same = sum(int(np.array_equal(first, np.asarray(f(tok, g)))) for _ in range(repeats))
    jax.block_until_ready(f(tok, g))
    t0 = time.perf_counter()
    for _ in range(20):
      r = f(tok, g)
    jax.block_until_ready(r)
    out[way] = {"repeats_bitwise": f"{same}/{repeats}", "ms": round((time.perf_counter() - t0) / 20 * 1e3, 3),
                "max_err_rel_to_max": float(np.abs(first - want).max() / scale)}
  return {"vocab": v, "dim": d, "tokens": int(np.prod(bt)), "max_count": int(np.bincount(np.asarray(tok).ravel()).max()),
          "ways": out}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--shapes", default=",".join(SHAPES))
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  unknown = sorted(set(a.shapes.split(",")) - set(SHAPES))
  if unknown:
    ap.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
  res = {**provenance(), "shapes": {}}
  print(f"{'shape':9} {'way':22} {'repeats bitwise':>15} {'ms':>9} {'err/max':>9}")
  for name in a.shapes.split(","):
    r = res["shapes"][name] = measure(name, a.repeats)
    for way, m in r["ways"].items():
      print(f"{name:9} {way:22} {m['repeats_bitwise']:>15} {m['ms']:9.3f} {m['max_err_rel_to_max']:9.1e}", flush=True)
    if a.out:  # after each shape: a run cut short by a time limit keeps the shapes it finished
      with open(a.out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
      os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
  main()
