"""The GQA attention block (Llama-3.x, Qwen2, Qwen3): projections (Qwen2: with q/k/v biases, ``fuse.project``),
optional QK-norm, RoPE, the attention op, KV cache."""

from __future__ import annotations

import jax.numpy as jnp

from fp8jax import attention as attn
from fp8jax import kvcache as kvc
from fp8jax import ops, sharding
from fp8jax.model import fuse
from fp8jax.model.config import ModelConfig
from fp8jax.model.layers import apply_rope, rms_norm
from fp8jax.model.schema import PARALLEL


def _amax(x):
  return jnp.max(jnp.abs(x.astype(jnp.float32)))


def _write_kernel(cfg: ModelConfig, lcfg, q, pool, k, page_table) -> bool:
  """Whether the paged cache write runs as one kernel (``pallas_kernels.kv_write``; bitwise the XLA scatters):
  where the attention kernels run, on one device (a mesh keeps the scatters, which XLA partitions)."""
  if page_table is None or sharding.multi_device(lcfg.mesh):
    return False
  if attn.resolve_backend(cfg.attn_backend, q, pool) != "pallas":
    return False
  from pallas_kernels import kv_write  # noqa: PLC0415 (the Pallas Triton backend, only where it runs)
  return kv_write.unsupported(pool, k) is None


def attention(p, x_BxTxD, positions_BxT, cfg: ModelConfig, lcfg, inv_freq, *, layer: int, cache, kv_scales,
              own_positions: bool = False):
  """GQA attention (``fp8jax.attention.attend``). Returns (out, new cache layer (k, v) or None, (amax K, amax V)).

  ``own_positions``: no cache and the positions are 0..T-1 (the training form, differentiable on every backend).
  """
  b, t, _ = x_BxTxD.shape
  hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  q, k, v = fuse.project(p, x_BxTxD, ("wq", "wk", "wv"), (hq * hd, hkv * hd, hkv * hd), lcfg)
  q, k, v = q.reshape(b, t, hq, hd), k.reshape(b, t, hkv, hd), v.reshape(b, t, hkv, hd)
  if cfg.qk_norm:
    q, k = (rms_norm(q, p["q_norm"], cfg.norm_eps, cfg.norm_backend, lcfg.mesh),
            rms_norm(k, p["k_norm"], cfg.norm_eps, cfg.norm_backend, lcfg.mesh))
  q, k = apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq)
  amax = (_amax(k), _amax(v))

  # K/V enter attention as (codes, scale): BF16 values with scale 1, or FP8 E4M3 codes whose per-layer scales
  # multiply the FP32 scores / outputs after the dots. The trainer (kv_scales: the codes as BF16 values) and the
  # sampler (the FP8 cache, read as FP8: half the bytes) run the same attention op on the same codes.
  new_layer = None
  if cache is None:
    sk = sv = None
    if kv_scales is not None:  # training with an FP8 rollout cache: the same quantization, straight-through
      sk, sv = kv_scales[0][layer], kv_scales[1][layer]
      k, v = kvc.kv_codes(k, sk), kvc.kv_codes(v, sv)
    out = attn.attend(q, k, v, None if own_positions else positions_BxT, k_scale=sk, v_scale=sv,
                      backend=cfg.attn_backend, mesh=lcfg.mesh)
  else:
    sk, sv = (cache.k_scale_L[layer], cache.v_scale_L[layer]) if cache.is_fp8 else (None, None)
    pt = cache.page_table
    ck, cv = kvc.store_layer(cache, layer, k, v, positions_BxT,
                             kernel=_write_kernel(cfg, lcfg, q, cache.k[layer], k, pt))
    new_layer = (ck, cv)
    out = attn.attend(q, ck, cv, positions_BxT, k_scale=sk, v_scale=sv, backend=cfg.attn_backend, mesh=lcfg.mesh,
                      page_table=pt, shared_blocks=cache.shared_blocks, pair_ordered=cache.pair_ordered)
  return ops.linear(out.reshape(b, t, hq * hd), p["wo"], lcfg, PARALLEL["wo"]), new_layer, amax
