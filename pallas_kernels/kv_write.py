"""The paged KV cache write in one Pallas (Triton backend) kernel: K and V of a layer, in place.

Reference: ``fp8jax.kvcache.store`` (an XLA scatter per cache, with the FP8 cache's quantization fused into it). The
kernel writes the same entries: row i of the new K/V (one token's (heads, head_dim) values) goes to offset
``offset[i]`` of page ``page[i]`` of the pool, quantized by the quantizer's own ``quantize_kv`` math for an FP8 pool
(``core.to_e4m3``, native cast when compiled, exact FP32 rounding in interpret mode: the same bits); rows with a
page outside the pool are dropped. The pools are aliased to the outputs (``input_output_aliases``), so inside the
sampler's jitted decode loop the cache is updated in place.

Why a kernel (measured on the H200, docs/history.md): at Llama-3.1-8B shapes a decode step ran the write as two
XLA scatter fusions per layer (K and V) of ~6 us each, 64 launches and ~0.42 ms per step; this is one launch per
layer. Data movement only: the cache's contents are bitwise those of the scatter (tests/test_kv_write.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import core


def unsupported(pool, new) -> str | None:
  """Why the kernel cannot write these operands (None if it can): Triton blocks need power-of-two extents."""
  h, d = new.shape[-2:]
  if pool.ndim != 4 or pool.shape[2:] != (h, d):
    return f"pool {tuple(pool.shape)} is not (pages, page, {h}, {d})"
  if h & (h - 1) or d & (d - 1):
    return f"(heads, head_dim) = ({h}, {d}) not powers of two"
  return None


def _kernel(page_ref, off_ref, *refs, layer: int, fp8: bool, pair_ordered: bool, native_cast: bool):
  sk_ref, sv_ref, kn_ref, vn_ref, _k_in, _v_in, k_ref, v_ref = refs if fp8 else (None, None, *refs)
  i = pl.program_id(0)
  page, off = page_ref[i], off_ref[i]
  d = kn_ref.shape[-1]
  # (source columns of the new row, destination columns of the pool row): the whole row, or for a pair-ordered
  # pool each head-dim half into every other column (dim j of half 0 at 2j, of half 1 at 2j + 1: ``pair_order``).
  pieces = ((pl.ds(0, d // 2), pl.ds(0, d // 2, stride=2)), (pl.ds(d // 2, d // 2), pl.ds(1, d // 2, stride=2))
            ) if pair_ordered else ((slice(None), slice(None)),)

  @pl.when((page >= 0) & (page < k_ref.shape[0]))
  def _():
    for new_ref, out_ref, s_ref in ((kn_ref, k_ref, sk_ref), (vn_ref, v_ref, sv_ref)):
      for src, dst in pieces:
        x = new_ref[i, :, src]
        if fp8:  # quantize_kv: codes of x * (1 / scale), the quantizer's rounding (elementwise: any columns)
          x = core.to_e4m3(x.astype(jnp.float32) * core.reciprocal(s_ref[layer]), native_cast=native_cast)
        out_ref[page, off, :, dst] = x.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("layer", "pair_ordered", "interpret"))
def paged_write(k_pool, v_pool, k_new_NxHxD, v_new_NxHxD, page_N, offset_N, k_scale_L=None, v_scale_L=None, *,
                layer: int = 0, pair_ordered: bool = False, interpret: bool = False):
  """-> (k_pool, v_pool) with row i of the new K/V at offset_N[i] of page page_N[i] (a page outside the pool:
  dropped, as the scatter's mode="drop" does). ``pair_ordered``: the pools hold head dims in pair order
  (``pallas_kernels.attention.pair_order``, the sampler's FP8 cache); the new rows come in natural order and the
  kernel writes them permuted (no XLA transpose of the new rows before it).

  Pools (pages, P, H, D), BF16 or float8_e4m3fn; for FP8, ``k_scale_L`` / ``v_scale_L`` are the cache's per-layer
  FP32 scales (L,) and ``layer`` this pool's layer (the arrays are read as they are: no op per layer builds the
  kernel's operands), and the new values are quantized as ``kvcache.quantize_kv`` does. Inside a jitted loop that
  carries the pools (the sampler's decode) they are updated in place; called on its own, XLA copies them first
  (nothing is donated)."""
  fp8 = k_pool.dtype == core.FP8_DTYPE
  if fp8 and (k_scale_L is None or v_scale_L is None or not 0 <= layer < k_scale_L.shape[0]):
    raise ValueError(f"paged_write: an FP8 pool needs k_scale_L and v_scale_L (per-layer scales) holding layer "
                     f"{layer}")
  for pool, new in ((k_pool, k_new_NxHxD), (v_pool, v_new_NxHxD)):
    why = unsupported(pool, new)
    if why or new.shape[0] != page_N.shape[0] or offset_N.shape != page_N.shape:
      raise ValueError(f"paged_write: pool {tuple(pool.shape)}, new {tuple(new.shape)}, page {tuple(page_N.shape)}, "
                       f"offset {tuple(offset_N.shape)}: {why or 'one page and offset per new row'}")
  scales = (k_scale_L.astype(jnp.float32), v_scale_L.astype(jnp.float32)) if fp8 else ()
  n = 2 + len(scales) + 2
  return pl.pallas_call(
      functools.partial(_kernel, layer=layer, fp8=fp8, pair_ordered=pair_ordered, native_cast=not interpret),
      out_shape=(jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)),
      grid=(page_N.shape[0],),
      input_output_aliases={n: 0, n + 1: 1},
      compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret, name="fp8jax_kv_write",
  )(page_N.astype(jnp.int32), offset_N.astype(jnp.int32), *scales, k_new_NxHxD, v_new_NxHxD, k_pool, v_pool)
