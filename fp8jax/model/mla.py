"""Multi-head latent attention (DeepSeek-V2 sec. 2.1, DeepSeek-V3; transformers' ``DeepseekV3Attention``).

Per token: q = q_b(norm(q_a x)) (or q_proj x without a q LoRA), split per head into q_nope (qk_nope_head_dim) and
q_rope (qk_rope_head_dim); kv_a x = [latent (kv_lora_rank), k_rope (qk_rope_head_dim)]; c = norm(latent). The
expanded form (transformers) builds per-head keys [W_UK_h c, k_rope] and values W_UV_h c from kv_b = [W_UK; W_UV]
and attends over them. fp8jax runs the **absorbed** form everywhere:

    score_h(t, s) = q_nope_h(t) . W_UK_h c(s) + q_rope_h(t) . k_rope(s)
                  = [W_UK_h^T q_nope_h(t), q_rope_h(t)] . [c(s), k_rope(s)]
    out_h(t)      = W_UV_h sum_s p_h(t, s) c(s)

i.e. multi-query attention of H query heads over one shared "key" [c, k_rope] of kv_lora_rank + qk_rope_head_dim
dims per token, whose first kv_lora_rank dims are also the value (the attention op gets it as k and v; the output's
last qk_rope_head_dim dims are dropped). That one vector per token and layer is the sampler's latent cache.

Why absorbed in training too: the one-engine contract (docs/design.md) needs the trainer's log-probs to be the
sampler's, and the two forms are equal in exact arithmetic only (different BF16 roundings). Decode must be absorbed
(the expanded form would re-expand the whole cache every step), so the training forward is absorbed as well. Its
price: multiply-adds per head and (query, key) pair grow from qk_nope + qk_rope + v_head_dim to
2 (kv_lora_rank + qk_rope_head_dim) (320 -> 1152 at Moonlight's shapes, 3.6x); the projections cost the same.

The per-head products with W_UK_h^T and W_UV_h are ``ops.grouped_linear`` over heads (rows sorted by head, one
group per head): batch-invariant rows, so a decode row is bitwise the training row (BF16; kv_b is not a recipe
linear, schema.py says why). The softmax scale is 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's
mscale(factor, mscale_all_dim)^2, as transformers' ``yarn_apply_mscale``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from fp8jax import attention as attn
from fp8jax import kvcache as kvc
from fp8jax import ops
from fp8jax.model.config import ModelConfig
from fp8jax.model.layers import apply_rope, rms_norm, rope_attention_factor, yarn_mscale

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
  s = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
  if cfg.rope_yarn is not None and cfg.rope_yarn[5]:
    m = yarn_mscale(cfg.rope_yarn[0], cfg.rope_yarn[5])
    s = s * m * m
  return s


def _amax(x):
  return jnp.max(jnp.abs(x.astype(jnp.float32)))


def per_head(x_BxTxHxI, w_HxOxI, lcfg: ops.LinearConfig):
  """y[b, t, h] = w_h x[b, t, h] for every head h: one grouped linear with the rows sorted by head."""
  b, t, h, i = x_BxTxHxI.shape
  rows = jnp.swapaxes(x_BxTxHxI.reshape(b * t, h, i), 0, 1).reshape(h * b * t, i)
  y = ops.grouped_linear(rows, w_HxOxI, jnp.full((h,), b * t, jnp.int32), lcfg)
  return jnp.swapaxes(y.reshape(h, b * t, -1), 0, 1).reshape(b, t, h, -1)


def absorbed_weights(wkv_b, cfg: ModelConfig):
  """kv_b (H (nope + v), rank) -> (W_UK^T (H, rank, nope): q_nope -> latent, W_UV (H, v, rank): latent -> v)."""
  w = wkv_b.reshape(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
  return jnp.swapaxes(w[:, :cfg.qk_nope_head_dim], 1, 2), w[:, cfg.qk_nope_head_dim:]


def attention(p, x_BxTxD, positions_BxT, cfg: ModelConfig, lcfg, inv_freq, *, layer: int, cache, kv_scales,
              own_positions: bool = False):
  """MLA -> (out, new cache layer (latent, None) or None, (amax, amax) of the latent key), like ``gqa.attention``.

  The latent key enters attention as BF16 values, or as E4M3 codes with one per-layer scale (``kv_scales[0]`` /
  the cache's ``k_scale_L``), which then scales both the scores and the output (it is the value too).
  """
  b, t, _ = x_BxTxD.shape
  h, dn, dr, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
  if cfg.q_lora_rank:
    qa = rms_norm(ops.linear(x_BxTxD, p["wq_a"], lcfg), p["q_a_norm"], LATENT_NORM_EPS, cfg.norm_backend,
                  lcfg.mesh)
    q = ops.linear(qa, p["wq_b"], lcfg)
  else:
    q = ops.linear(x_BxTxD, p["wq"], lcfg)
  q = q.reshape(b, t, h, dn + dr)
  kv = ops.linear(x_BxTxD, p["wkv_a"], lcfg)
  c = rms_norm(kv[..., :r], p["kv_a_norm"], LATENT_NORM_EPS, cfg.norm_backend, lcfg.mesh)
  rope = dict(interleaved=cfg.rope_interleave, scale=rope_attention_factor(cfg))
  q_rope = apply_rope(q[..., dn:], positions_BxT, inv_freq, **rope)
  k_rope = apply_rope(kv[..., None, r:], positions_BxT, inv_freq, **rope)
  w_uk_t, w_uv = absorbed_weights(p["wkv_b"], cfg)
  q_abs = jnp.concatenate([per_head(q[..., :dn], w_uk_t, lcfg), q_rope], axis=-1)  # (B, T, H, rank + rope)
  key = jnp.concatenate([c[:, :, None, :], k_rope.astype(c.dtype)], axis=-1)  # (B, T, 1, rank + rope)
  amax = _amax(key)
  sm = softmax_scale(cfg)

  new_layer = None
  if cache is None:
    s = None
    if kv_scales is not None:  # training with an FP8 rollout cache: the same codes, straight-through
      s = kv_scales[0][layer]
      key = kvc.kv_codes(key, s)
    out = attn.attend(q_abs, key, key, None if own_positions else positions_BxT, k_scale=s, v_scale=s, sm_scale=sm,
                      backend=cfg.attn_backend, mesh=lcfg.mesh)
  else:
    if cache.pair_ordered:
      raise ValueError("MLA's latent cache is read in natural order; it cannot be pair_ordered")
    s = cache.k_scale_L[layer] if cache.is_fp8 else None
    ck = kvc.store(cache.k[layer], key, s, positions_BxT, cache.page_table)
    new_layer = (ck, None)
    out = attn.attend(q_abs, ck, ck, positions_BxT, k_scale=s, v_scale=s, sm_scale=sm, backend=cfg.attn_backend,
                      mesh=lcfg.mesh, page_table=cache.page_table)
  o = per_head(out[..., :r], w_uv, lcfg)  # (B, T, H, v_head_dim)
  return ops.linear(o.reshape(b, t, h * cfg.v_head_dim), p["wo"], lcfg), new_layer, (amax, amax)
