"""The model function: a Llama-3.x / Qwen3-dense decoder as pure functions over a params pytree.

One ``forward`` serves training and sampling:
  * training: ``forward(params, tokens_BxT, cfg)`` — full causal sequence, positions 0..T-1, no cache;
  * sampling: ``forward(params, tokens_BxT, cfg, positions_BxT=..., cache=...)`` — writes the new K/V at their
    positions into the cache and attends over the cache (prefill: T = prompt bucket; decode: T = 1).
The attention rule is the same in both: a query at position p sees keys at positions j <= p. So the logits the
sampler computes for a token are the trainer's logits for that token (same GEMMs, same quantizer).

Params (master weights FP32; linear weights stored (out, in)):
  embed (V, D); layers: list of {attn_norm (D), wq (Hq*hd, D), wk/wv (Hkv*hd, D), wo (D, Hq*hd), mlp_norm (D),
  w_gate/w_up (F, D), w_down (D, F), [q_norm/k_norm (hd) when qk_norm]}; final_norm (D); lm_head (V, D) unless tied.
A layer list (not a stacked scan) lets the FP8 recipe keep any layer in BF16 without changing the code path.
Linear weights may be plain arrays (BF16 mode), ``FP8Weight`` (training) or ``QWeight`` (sampling): see fp8jax.ops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from fp8jax import attention as attn
from fp8jax import kvcache as kvc
from fp8jax import ops
from fp8jax.model.config import ModelConfig

# ------------------------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------------------------


# Rows with max |x| above this are rescaled before mean(x^2): below it, x^2 <= 2**96 and a sum of up to 2**32 of them
# stays below FP32's max (2**128).
_RMS_SAFE_AMAX = 2.0**48


def rms_norm(x, w, eps):
  """HF LlamaRMSNorm: normalize in FP32, cast back, then scale.

  mean(x^2) overflows FP32 once |x| passes ~1e19 (the hidden state then becomes 0; seen with a diverging learning
  rate), so a row whose max |x| exceeds ``_RMS_SAFE_AMAX`` is first multiplied by a power of two ``s`` that brings
  it into [0.5, 1) (exact), and normalized as ``xs * rsqrt(mean(xs^2) + eps s^2)``, the same value. Every other row
  has ``s = 1``, where each operation, and so the result, is bitwise the plain formula. Non-finite rows keep s = 1.
  """
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
  _, exp = jnp.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1)
  scale = jnp.where((amax > _RMS_SAFE_AMAX) & jnp.isfinite(amax),
                    jnp.ldexp(jnp.float32(1.0), -jnp.minimum(exp, 126)), jnp.float32(1.0))  # 2**-126: normal
  xs = x32 * scale
  y = xs * jax.lax.rsqrt(jnp.mean(xs * xs, axis=-1, keepdims=True) + eps * (scale * scale))
  return w.astype(x.dtype) * y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """RoPE inverse frequencies, with Llama-3 scaling (HF rope_type "llama3") when cfg.rope_scaling is set."""
  hd = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  if cfg.rope_scaling is None:
    return inv
  factor, low, high, old_ctx = cfg.rope_scaling
  wavelen = 2 * math.pi / inv
  low_wl, high_wl = old_ctx / low, old_ctx / high
  scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
  smooth = (old_ctx / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_wl) & (wavelen <= low_wl)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxTxHxD, positions_BxT, inv_freq):
  """Rotate-half RoPE (the HF convention: first and second halves of head_dim form the pairs)."""
  ang = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # (B, T, hd/2)
  emb = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x_BxTxHxD.dtype), jnp.sin(emb).astype(x_BxTxHxD.dtype)
  x1, x2 = jnp.split(x_BxTxHxD, 2, axis=-1)
  return x_BxTxHxD * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _amax(x):
  return jnp.max(jnp.abs(x.astype(jnp.float32)))


def attention(p, x_BxTxD, positions_BxT, cfg: ModelConfig, lcfg, inv_freq, *, layer: int, cache, kv_scales,
              own_positions: bool = False):
  """GQA attention (``fp8jax.attention.attend``). Returns (out, new cache layer (k, v) or None, (amax K, amax V)).

  ``own_positions``: no cache and the positions are 0..T-1 (the training form, differentiable on every backend).
  """
  b, t, _ = x_BxTxD.shape
  hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  q = ops.linear(x_BxTxD, p["wq"], lcfg).reshape(b, t, hq, hd)
  k = ops.linear(x_BxTxD, p["wk"], lcfg).reshape(b, t, hkv, hd)
  v = ops.linear(x_BxTxD, p["wv"], lcfg).reshape(b, t, hkv, hd)
  if cfg.qk_norm:
    q, k = rms_norm(q, p["q_norm"], cfg.norm_eps), rms_norm(k, p["k_norm"], cfg.norm_eps)
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
    ck, cv = cache.k[layer], cache.v[layer]
    sk = sv = None
    if cache.is_fp8:
      sk, sv = cache.k_scale_L[layer], cache.v_scale_L[layer]
      ck = kvc.write(ck, kvc.quantize_kv(k, sk), positions_BxT)
      cv = kvc.write(cv, kvc.quantize_kv(v, sv), positions_BxT)
    else:
      ck, cv = kvc.write(ck, k, positions_BxT), kvc.write(cv, v, positions_BxT)
    new_layer = (ck, cv)
    out = attn.attend(q, ck, cv, positions_BxT, k_scale=sk, v_scale=sv, backend=cfg.attn_backend, mesh=lcfg.mesh)
  return ops.linear(out.reshape(b, t, hq * hd), p["wo"], lcfg), new_layer, amax


def mlp(p, x, lcfg):
  gate = ops.linear(x, p["w_gate"], lcfg)
  up = ops.linear(x, p["w_up"], lcfg)
  return ops.linear(jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up, p["w_down"], lcfg)


# ------------------------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardAux:
  k_amax_L: jax.Array  # (L,) max |K| per layer (post-RoPE), for FP8 KV-scale calibration
  v_amax_L: jax.Array


def forward(params, tokens_BxT, cfg: ModelConfig, lcfg: ops.LinearConfig = ops.LinearConfig(), *,
            positions_BxT=None, cache: kvc.KVCache | None = None, kv_scales=None):
  """Decoder forward -> (hidden_BxTxD after the final norm, new cache or None, ForwardAux).

  ``kv_scales``: (k_scale_L, v_scale_L) to fake-quantize K/V like an FP8 rollout cache (training only; with a
  cache the cache's own scales are used). Logits: ``logits(params, hidden, cfg)``.
  """
  b, t = tokens_BxT.shape
  own_positions = positions_BxT is None and cache is None
  if positions_BxT is None:
    if cache is not None:
      raise ValueError("forward with a KV cache needs positions_BxT (where to write the new tokens)")
    positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  dtype = jnp.dtype(cfg.dtype)
  lcfg = dataclasses.replace(lcfg, out_dtype=cfg.dtype)
  x = params["embed"].astype(dtype)[tokens_BxT]
  inv_freq = rope_inv_freq(cfg)

  def layer_fn(p, x, layer_cache, i):
    h, new_layer, amax = attention(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), positions_BxT, cfg, lcfg, inv_freq,
                                   layer=i, cache=layer_cache, kv_scales=kv_scales, own_positions=own_positions)
    x = x + h
    x = x + mlp(p, rms_norm(x, p["mlp_norm"], cfg.norm_eps), lcfg)
    return x, new_layer, amax

  if cfg.remat and cache is None:
    layer_fn = jax.checkpoint(layer_fn, static_argnums=(3,))
  new_k, new_v, k_amax, v_amax = [], [], [], []
  for i, p in enumerate(params["layers"]):
    x, new_layer, (ka, va) = layer_fn(p, x, cache, i)
    k_amax.append(ka)
    v_amax.append(va)
    if new_layer is not None:
      new_k.append(new_layer[0])
      new_v.append(new_layer[1])
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  new_cache = None if cache is None else dataclasses.replace(cache, k=new_k, v=new_v)
  return x, new_cache, ForwardAux(jnp.stack(k_amax), jnp.stack(v_amax))


def logits(params, hidden_BxTxD, cfg: ModelConfig, lcfg: ops.LinearConfig = ops.LinearConfig()):
  """FP32 logits of the output head (tied to the embedding when cfg.tie_embeddings)."""
  head = params["embed"] if cfg.tie_embeddings else params["lm_head"]
  return ops.linear(hidden_BxTxD, head, dataclasses.replace(lcfg, out_dtype="float32"))


def token_logprobs(logits_BxTxV, tokens_BxT, temperature: float = 1.0):
  """log softmax(logits / temperature)[token]: the one definition the sampler and the trainer share."""
  lp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
  return jnp.take_along_axis(lp, tokens_BxT[..., None], axis=-1)[..., 0]


def token_entropy(logits_BxTxV, temperature: float = 1.0):
  lp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32) / temperature, axis=-1)
  return -jnp.sum(jnp.exp(lp) * lp, axis=-1)


def next_token_logprobs(params, tokens_BxL, cfg: ModelConfig, lcfg: ops.LinearConfig = ops.LinearConfig(), *,
                        temperature: float = 1.0, kv_scales=None):
  """The trainer's full-sequence view: (log-prob (B, L-1) of each next token, its entropy, ForwardAux)."""
  hidden, _, aux = forward(params, tokens_BxL, cfg, lcfg, kv_scales=kv_scales)
  lg = logits(params, hidden[:, :-1], cfg, lcfg)
  return token_logprobs(lg, tokens_BxL[:, 1:], temperature), token_entropy(lg, temperature), aux


# ------------------------------------------------------------------------------------------------------------------
# Init
# ------------------------------------------------------------------------------------------------------------------


def param_shapes(cfg: ModelConfig) -> dict:
  """Shapes of every parameter (the params pytree with tuples as leaves)."""
  d, f = cfg.dim, cfg.ffn_dim
  layer = {"attn_norm": (d,), "wq": (cfg.q_dim, d), "wk": (cfg.kv_dim, d), "wv": (cfg.kv_dim, d),
           "wo": (d, cfg.q_dim), "mlp_norm": (d,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
  if cfg.qk_norm:
    layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
  shapes = {"embed": (cfg.vocab_size, d), "layers": [dict(layer) for _ in range(cfg.n_layers)], "final_norm": (d,)}
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (cfg.vocab_size, d)
  return shapes


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> dict:
  """Deterministic init: N(0, std) for matrices (output projections scaled by 1/sqrt(2 L)), ones for norms.

  Leaf by leaf (one small jit per shape), so 8B-sized random weights compile in seconds.
  """
  key = jax.random.key(seed)
  shapes = param_shapes(cfg)
  leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  out = []
  for i, (path, shape) in enumerate(leaves):
    name = jax.tree_util.keystr(path)
    if len(shape) == 1:
      out.append(jnp.ones(shape, dtype))
    else:
      s = std / math.sqrt(2 * cfg.n_layers) if ("'wo'" in name or "'w_down'" in name) else std
      out.append(_normal(jax.random.fold_in(key, i), shape, jnp.dtype(dtype), s))
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2))  # random init: rounding mode irrelevant
def _normal_jit(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _normal(key, shape, dtype, std):
  return (_normal_jit(key, shape, dtype) * jnp.asarray(std, dtype)).astype(dtype)
