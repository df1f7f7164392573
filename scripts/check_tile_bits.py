"""Which attention tiles give a row the same bits? Two checks on a CUDA GPU (H200), one table, one JSON.

  PYTHONPATH=. python3 scripts/check_tile_bits.py [--out DIR]

1. Tensor-core dots per element across tile shapes: a Pallas (Triton) kernel computes, per tile of ``bq`` rows and
   ``w`` warps, the three dot forms of the attention tile (c * alpha + P . V, Q . K^T, a row sum as a dot with ones)
   on the same random FP16 / BF16 operands; every tile shape is compared with the 64-row, 4-warp one (wgmma), the
   16- and 32-row ones run mma.sync. Measured 2026-12-04: all bitwise equal, so the instruction shape does not change
   an element's result.
2. The decode tile vs the training rows over FP8 K/V: decode (64 x 4 and 16 x 4 tiles) over the FP8 cache and over its
   FP16 copy, training (``attention_seq``) over the FP16 codes (as the trainer feeds them) and over the FP8 codes,
   at a dozen positions; the count of differing output elements for each pair.
   Measured 2026-12-04: everything equal except the 16 x 4 tile over FP8 codes (19 of 196,608 elements, ~1 BF16
   ulp): with an 8-bit source Triton gives the mma.sync operands kWidth = 4 (each thread's four consecutive k
   values), which permutes k inside each 16-wide step of both dots, and the tensor core's sum inside a step is not
   order-free; over FP16 or BF16 K/V (kWidth = 2) the 16-row tile is bitwise the training rows.
   ``scripts/triton_resources.py`` shows the kWidth and the resources of each form on a CPU machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8jax  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

TILES = [(64, 4), (128, 8), (128, 4), (16, 1), (16, 4), (32, 2), (32, 4), (16, 2)]


def _dots_kernel(a_ref, b_ref, bt_ref, c_ref, al_ref, pv_ref, qk_ref, sum_ref, *, bq):
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * bq, bq), bq)
  a, c, al = a_ref[rows, :], c_ref[rows, :], al_ref[rows]
  f32 = jnp.float32
  pv_ref[rows, :] = c * al[:, None] + lax.dot_general(a, b_ref[...], (((1,), (0,)), ((), ())),
                                                      preferred_element_type=f32)
  qk_ref[rows, :] = lax.dot_general(a, bt_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=f32)
  ones = jnp.ones((a.shape[1], 16), a.dtype)  # every column the row sum: max picks one exactly
  sum_ref[rows] = al * jnp.max(c, axis=1) + jnp.max(
      lax.dot_general(a, ones, (((1,), (0,)), ((), ())), preferred_element_type=f32), axis=1)


@functools.partial(jax.jit, static_argnames=("bq", "warps"))
def _dots(a, b, bt, c, al, bq, warps):
  m, n = a.shape[0], b.shape[1]
  f32 = jnp.float32
  return pl.pallas_call(
      functools.partial(_dots_kernel, bq=bq),
      out_shape=(jax.ShapeDtypeStruct((m, n), f32), jax.ShapeDtypeStruct((m, n), f32),
                 jax.ShapeDtypeStruct((m,), f32)),
      grid=(m // bq,), compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1))(a, b, bt, c, al)


def dot_rows(m=2048, k=128, n=128):
  rows = []
  for dt in (jnp.float16, jnp.bfloat16):
    ks = jax.random.split(jax.random.key(0), 6)
    scale = jnp.exp2(jax.random.randint(ks[5], (m, 1), -12, 12).astype(jnp.float32))  # subnormal FP16 too
    a = (jax.random.normal(ks[0], (m, k)) * scale).astype(dt)
    a = jnp.where(jax.random.uniform(ks[4], (m, k)) < 0.3, jnp.abs(a), a)
    b, bt = jax.random.normal(ks[1], (k, n)).astype(dt), jax.random.normal(ks[2], (n, k)).astype(dt)
    c = jax.random.normal(ks[3], (m, n), jnp.float32) * 100
    al = jax.random.uniform(ks[4], (m,), jnp.float32)
    base = [np.asarray(x) for x in _dots(a, b, bt, c, al, *TILES[0])]
    for bq, w in TILES:
      out = [np.asarray(x) for x in _dots(a, b, bt, c, al, bq, w)]
      rows.append(dict(dtype=jnp.dtype(dt).name, tile=f"{bq}x{w}",
                       differing=dict(zip(("pv", "qk", "rowsum"), (int(np.sum(x != y)) for x, y in zip(out, base))))))
  return rows


def decode_rows(b=4, t=1500, d=128):
  import bench_attention as ba  # noqa: PLC0415
  from fp8jax import attention as attn, kvcache  # noqa: PLC0415
  from pallas_kernels import attention_triton as kern  # noqa: PLC0415
  TC = kern.TuningConfig
  q, k, v, _ = ba._inputs(b, t, seed=8)
  ks = vs = jnp.float32(4 / 448)
  k, v = kvcache.quantize_kv(k, ks), kvcache.quantize_kv(v, vs)
  qs, vsc = attn._scales(d, ks, vs)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  ps = np.array([0, 5, 127, 128, 130, 255, 256, 700, 1023, 1024, 1400, 1499])
  f16 = (k.astype(jnp.float16), v.astype(jnp.float16))
  out = {f"train over {n}": np.asarray(kern.attention_seq(q, *kv, pos, qs, vsc)[0])[:, ps]
         for n, kv in (("f16 codes", f16), ("f8 codes", (k, v)))}
  for n, kv in (("f8 cache", (k, v)), ("f16 cache", f16)):
    for bq, w in ((64, 4), (16, 4)):
      cfg = TC(decode_block_q=bq, decode_num_warps=w)
      out[f"decode {bq}x{w} over {n}"] = np.stack(
          [np.asarray(kern.attention_heads(q[:, p], *kv, jnp.full((b,), p, jnp.int32), qs, vsc, config=cfg))
           for p in ps], axis=1)
  names = list(out)
  return [dict(a=a, b=c, differing=int(np.sum(out[a] != out[c])), of=int(out[a].size))
          for i, a in enumerate(names) for c in names[i + 1:]]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  a = p.parse_args()
  result = dict(**provenance(), dots=dot_rows(), decode=decode_rows())
  with open(os.path.join(a.out, "tile_bits.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(f"{'dtype':9s} {'tile':6s}  differing from 64x4 (pv, qk, rowsum)")
  for r in result["dots"]:
    print(f"{r['dtype']:9s} {r['tile']:6s}  {r['differing']}")
  print("\nFP8 K/V, output elements differing")
  for r in result["decode"]:
    print(f"{r['a']:28s} vs {r['b']:28s} {r['differing']:6d} / {r['of']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
