"""KV cache for the sampler (BF16 or FP8 E4M3), and the K/V quantization the trainer shares with it.

Layout: per decoder layer, ``k`` and ``v`` are (slots, length, n_kv_heads, head_dim); slot ``j`` of a row holds
the key/value of the token at position ``j`` (post-RoPE keys). A query at position ``p`` attends slots ``j <= p``.
The length is the requested ``max_len`` rounded up to the attention op's key block (``padded_len``: 128 for the GPU
kernels, 16 for the CPU reference), so attention reads whole blocks without a padded copy of the cache; the sampler
still stops sequences at its max_len.

Paged (the sampler's cache): per layer a pool of pages (n_pages, P, n_kv_heads, head_dim), P = the attention key
block, and ``page_table`` (slots, Nb): key block n of slot s is page page_table[s, n]. Pages of a prompt are shared by
its samples (written once at prefill); attention reads through the table (``fp8jax.attention.attend(page_table=)``),
block by block in the same order as a dense row, so paging changes no bit. A dense cache has ``page_table`` None.
``shared_blocks`` (set by the sampler per decode step) says how many of a slot's first pages are its prompt's, so
that the decode kernels read those pages once for all the prompt's samples (same bits).

MLA (``fp8jax.model.mla``): one latent per token and layer, (slots, length, 1, kv_lora_rank + qk_rope_head_dim) in
``k``, and no ``v`` (an empty list): the absorbed attention reads the latent as keys and its first kv_lora_rank dims
as values. An FP8 latent cache has one scale per layer (``k_scale_L``), applied to the scores and the output.

FP8 cache: one FP32 scale per layer for K and one for V (per-tensor, as vLLM's FP8 KV cache). On write the values
are quantized with ``quantize_kv``; attention reads the E4M3 codes (upcast exactly to BF16) and multiplies the
FP32 scores / outputs by the per-layer scale after the dots. When the rollout uses an FP8 cache, the training forward
turns K/V into the same codes with ``kv_codes`` (same scales, straight-through gradient), so sampler and trainer run
the same attention math on the same numbers.

Scale statistic (documented contract, used by the RL loop): ``scale = margin * amax / 448`` where ``amax`` is the
largest |K| (resp. |V|) of that layer seen in the last calibration pass (the previous training step's forward, or
a BF16 prefill of the prompts before the first training step) and ``margin`` (config ``rollout.kv_scale_margin``,
default 1.25) leaves headroom for values larger than those seen; larger values saturate at +-448 * scale.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from fp8jax import quant
from pallas_kernels.attention import BLOCK_KV, key_block, pair_order


@contextlib.contextmanager
def gpu_pages():
  """Inside, ``key_block()`` is the GPU kernels' page size (BLOCK_KV positions) on any backend: the exact rows of a
  memory plan for a GPU made on the CPU, whose reference attention pages are smaller (``scripts/plan_memory.py
  --devices``; the CPU reference cannot compile programs on these pages, so such a plan has no temporaries)."""
  global key_block
  own = key_block
  key_block = lambda: BLOCK_KV  # noqa: E731
  try:
    yield
  finally:
    key_block = own


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: list  # per layer (B, S, Hkv, hd), bf16 or float8_e4m3fn; paged: (n_pages, P, Hkv, hd)
  v: list  # the same, or [] for an MLA latent cache
  k_scale_L: jax.Array  # (L,) FP32; ones for a BF16 cache
  v_scale_L: jax.Array
  page_table: jax.Array | None = None  # (B, Nb) int32 for a paged cache
  # (B,) int32, paged decode: slot b's first shared_blocks[b] pages are its prompt's, shared with the prompt's other
  # samples (same first page, same count); attention then reads them once per group (``fp8jax.attention.attend``)
  shared_blocks: jax.Array | None = None
  # FP8 GQA caches read by the attention kernels: each row's head dims in pair order (``pallas_kernels.attention.
  # pair_order``; ``store_layer`` writes so, ``fp8jax.attention.attend(pair_ordered=)`` reads so). Static.
  pair_ordered: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def is_fp8(self) -> bool:
    return self.k[0].dtype == quant.FP8_DTYPE

  @property
  def max_len(self) -> int:
    """Allocated positions per slot (``padded_len`` of the requested length)."""
    if self.page_table is not None:
      return self.page_table.shape[1] * self.k[0].shape[1]
    return self.k[0].shape[1]

  @property
  def slots(self) -> int:
    return self.k[0].shape[0] if self.page_table is None else self.page_table.shape[0]


def padded_len(max_len: int) -> int:
  """The cache length allocated for ``max_len`` positions: a whole number of attention key blocks."""
  block = key_block()
  return -(-max_len // block) * block


def cache_bytes(n_layers: int, slots: int, max_len: int, n_kv_heads: int, head_dim: int, fp8: bool,
                values: bool = True) -> int:
  return (1 + values) * n_layers * slots * padded_len(max_len) * n_kv_heads * head_dim * (1 if fp8 else 2)


def init_pages(n_layers: int, n_pages: int, page_table, n_kv_heads: int, head_dim: int, *, fp8: bool,
               k_scale_L=None, v_scale_L=None, dtype=jnp.bfloat16, values: bool = True,
               pair_ordered: bool = False) -> KVCache:
  """A paged cache of ``n_pages`` zeroed pages of ``key_block()`` positions (``page_table`` (slots, Nb) names them).
  ``pair_ordered``: an FP8 K/V cache with head dims in pair order (``KVCache.pair_ordered``)."""
  if pair_ordered and not (fp8 and values):
    raise ValueError("init_pages: pair_ordered is for FP8 K/V caches (fp8=True, values=True)")
  c = init_cache(n_layers, n_pages, key_block(), n_kv_heads, head_dim, fp8=fp8, k_scale_L=k_scale_L,
                 v_scale_L=v_scale_L, dtype=dtype, values=values)
  return dataclasses.replace(c, page_table=jnp.asarray(page_table, jnp.int32), pair_ordered=pair_ordered)


def copy_pages(cache: KVCache, src_N, dst_N) -> KVCache:
  """Page dst[i] := page src[i] in every layer (dst out of range: dropped), in place where the cache is donated."""
  def cp(x):
    return x.at[dst_N].set(x[jnp.clip(src_N, 0, x.shape[0] - 1)], mode="drop")

  return dataclasses.replace(cache, k=[cp(x) for x in cache.k], v=[cp(x) for x in cache.v])


def init_cache(n_layers: int, slots: int, max_len: int, n_kv_heads: int, head_dim: int, *, fp8: bool,
               k_scale_L=None, v_scale_L=None, dtype=jnp.bfloat16, values: bool = True) -> KVCache:
  """``values=False``: keys only (MLA's latent cache, ``ModelConfig.kv_cache_layout``)."""
  dt = quant.FP8_DTYPE if fp8 else dtype
  shape = (slots, padded_len(max_len), n_kv_heads, head_dim)
  ones = jnp.ones((n_layers,), jnp.float32)
  return KVCache(k=[jnp.zeros(shape, dt) for _ in range(n_layers)],
                 v=[jnp.zeros(shape, dt) for _ in range(n_layers if values else 0)],
                 k_scale_L=ones if k_scale_L is None else jnp.array(k_scale_L, jnp.float32, copy=True),
                 v_scale_L=ones if v_scale_L is None else jnp.array(v_scale_L, jnp.float32, copy=True))


def scales_from_amax(amax_L: jax.Array, margin: float) -> jax.Array:
  """Per-layer FP8 KV scale from an observed amax (see module docstring)."""
  return jnp.maximum(margin * amax_L.astype(jnp.float32), quant.AMAX_FLOOR) * jnp.float32(quant.INV_E4M3_MAX)


def quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
  return quant.to_e4m3(x.astype(jnp.float32) * quant.reciprocal(scale))


def dequantize_kv(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  return (q.astype(jnp.float32) * scale).astype(dtype)


@jax.custom_vjp
def kv_codes(x: jax.Array, scale: jax.Array) -> jax.Array:
  """The E4M3 codes of quantize_kv(x, scale) as x's dtype (exact), with a straight-through gradient (g / scale).

  Attention multiplies the scores / outputs by ``scale`` after the dots, so the forward equals attention over the
  FP8 cache's values and the backward is the identity through the quantization.
  """
  return quantize_kv(x, scale).astype(x.dtype)


def _codes_fwd(x, scale):
  return kv_codes(x, scale), scale


def _codes_bwd(scale, g):
  return (g.astype(jnp.float32) * quant.reciprocal(scale)).astype(g.dtype), jnp.zeros_like(scale)


kv_codes.defvjp(_codes_fwd, _codes_bwd)


def store(cache_BxSxHxD: jax.Array, new_BxTxHxD: jax.Array, scale, positions_BxT: jax.Array,
          page_table=None) -> jax.Array:
  """``write`` of the new entries as the cache holds them: E4M3 codes of ``quantize_kv(new, scale)`` for an FP8
  cache (``scale`` its layer's scale), the values themselves for a BF16 one (``scale`` None)."""
  return write(cache_BxSxHxD, new_BxTxHxD if scale is None else quantize_kv(new_BxTxHxD, scale), positions_BxT,
               page_table)


def store_layer(cache: KVCache, layer: int, k_new_BxTxHxD, v_new_BxTxHxD, positions_BxT, *, kernel: bool = False):
  """``store`` of a GQA layer's K and V -> (k, v) of that layer. ``kernel`` (paged caches only): one Pallas launch
  writes both (``pallas_kernels.kv_write``, bitwise the two scatters; the caller picks it where the attention
  kernels run, ``fp8jax.model.gqa``); it reads the layer's FP8 scales from the cache's (L,) arrays, so no per-layer
  op builds its operands."""
  pt, fp8 = cache.page_table, cache.is_fp8
  if not kernel or pt is None:
    if cache.pair_ordered:  # a permutation of the new rows' head dims, before the (elementwise) quantization
      k_new_BxTxHxD, v_new_BxTxHxD = pair_order(k_new_BxTxHxD), pair_order(v_new_BxTxHxD)
    sk, sv = (cache.k_scale_L[layer], cache.v_scale_L[layer]) if fp8 else (None, None)
    return (store(cache.k[layer], k_new_BxTxHxD, sk, positions_BxT, pt),
            store(cache.v[layer], v_new_BxTxHxD, sv, positions_BxT, pt))
  from pallas_kernels import kv_write  # noqa: PLC0415 (imports the Pallas Triton backend only when asked for)
  kp, vp = cache.k[layer], cache.v[layer]
  page, offset = _page_offsets(kp, positions_BxT, pt)  # out of range: page = pool size, dropped by the kernel too
  h, d = k_new_BxTxHxD.shape[-2:]
  scales = dict(k_scale_L=cache.k_scale_L, v_scale_L=cache.v_scale_L, layer=layer) if fp8 else {}
  return kv_write.paged_write(kp, vp, k_new_BxTxHxD.reshape(-1, h, d), v_new_BxTxHxD.reshape(-1, h, d),
                              page.reshape(-1), offset.reshape(-1), pair_ordered=cache.pair_ordered, **scales)


def _page_offsets(pool, positions_BxT, page_table):
  """(page, offset) of each position in a paged cache; page = pool size (out of range) for a position outside the
  table (negative, or past its last block)."""
  p, nb = pool.shape[1], page_table.shape[1]
  blk = positions_BxT // p
  page = jnp.take_along_axis(page_table, jnp.clip(blk, 0, nb - 1), axis=1)
  return jnp.where((positions_BxT >= 0) & (blk < nb), page, pool.shape[0]), positions_BxT % p


def write(cache_BxSxHxD: jax.Array, new_BxTxHxD: jax.Array, positions_BxT: jax.Array, page_table=None) -> jax.Array:
  """Writes each row's new entries at their positions (positions >= max_len are dropped). Paged (``page_table``
  (B, Nb)): position p of row b goes to offset p % P of page page_table[b, p // P]."""
  new = new_BxTxHxD.astype(cache_BxSxHxD.dtype)
  if page_table is None:
    b_idx = jnp.arange(new_BxTxHxD.shape[0])[:, None]
    return cache_BxSxHxD.at[b_idx, positions_BxT].set(new, mode="drop")
  page, offset = _page_offsets(cache_BxSxHxD, positions_BxT, page_table)
  return cache_BxSxHxD.at[page, offset].set(new, mode="drop")
