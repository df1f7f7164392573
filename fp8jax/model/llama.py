"""The model function: a Llama-3.x / Qwen3 / DeepSeek-V3 decoder as pure functions over a params pytree.

One ``forward`` serves training and sampling:
  * training: ``forward(params, tokens_BxT, cfg)`` — full causal sequence, positions 0..T-1, no cache;
  * sampling: ``forward(params, tokens_BxT, cfg, positions_BxT=..., cache=...)`` — writes the new K/V at their
    positions into the cache and attends over the cache (prefill: T = prompt bucket; decode: T = 1).
The attention rule is the same in both: a query at position p sees keys at positions j <= p. So the logits the
sampler computes for a token are the trainer's logits for that token (same GEMMs, same quantizer).

Params (master weights FP32; linear weights stored (out, in)): embed, a list of layers, final_norm, lm_head unless
tied, as ``fp8jax.model.schema`` lists them (the one table of keys, shapes, shardings and HF names). The blocks are
in their own files: ``gqa`` (attention), ``mla`` (multi-head latent attention), ``mlp`` (dense SwiGLU), ``moe``
(Qwen3-MoE and DeepSeek-V3 MoE), ``layers`` (RMSNorm, RoPE).
A layer list (not a stacked scan) lets the FP8 recipe keep any layer in BF16 without changing the code path.
Linear weights may be plain arrays (BF16 mode), ``FP8Weight`` (training) or ``QWeight`` (sampling): see fp8jax.ops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from fp8jax import kvcache as kvc
from fp8jax import ops
from fp8jax.model import head, schema
from fp8jax.model.config import ModelConfig
from fp8jax.model import gqa, mla
from fp8jax.model import remat as remat_lib
from fp8jax.model.layers import add_rms_norm, embed, rope_inv_freq
from pallas_kernels.rms_norm import residual_add
from fp8jax.model.mlp import mlp
from fp8jax.model.moe import RouterStats, moe

# ------------------------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardAux:
  k_amax_L: jax.Array  # (L,) max |K| per layer (post-RoPE), for FP8 KV-scale calibration
  v_amax_L: jax.Array
  router: tuple[RouterStats, ...] = ()  # one per MoE layer, in layer order (moe.load_balancing_loss)
  residuals: tuple[jax.Array, ...] = ()  # forward(..., residuals=True): the residual stream, embeddings first


def decoder_layer(p, x, h_prev, positions_BxT, cfg: ModelConfig, lcfg: ops.LinearConfig, inv_freq, *, layer: int,
                  cache, kv_scales, own_positions: bool = False, router_mask_BxT=None, defer_add: bool = False):
  """One pre-norm decoder layer -> ((x, h), new cache layer or None, (amax K, amax V), RouterStats or None).

  The residual stream after the layer is x + h (``add_rms_norm``'s add): with ``defer_add`` the layer returns x and
  its MLP output h apart, and the next layer (``h_prev``) or the final norm adds them inside its norm kernel;
  otherwise it returns (x + h, None). ``h_prev``: the previous layer's deferred MLP output, or None.
  The MLP is the dense SwiGLU or, in MoE layers (``cfg.is_moe_layer``), the MoE block (``moe``).
  ``lcfg.out_dtype`` must already be the activation dtype (``forward`` sets it)."""
  norm = functools.partial(add_rms_norm, eps=cfg.norm_eps, backend=cfg.norm_backend, mesh=lcfg.mesh)
  x, hn = norm(x, h_prev, p["attn_norm"])
  attention = mla.attention if cfg.is_mla else gqa.attention
  h, new_layer, amax = attention(p, hn, positions_BxT, cfg, lcfg, inv_freq, layer=layer, cache=cache,
                                 kv_scales=kv_scales, own_positions=own_positions)
  x, hn = norm(x, h, p["mlp_norm"])
  stats = None
  if cfg.is_moe_layer(layer):
    h, stats = moe(p, hn, cfg, lcfg, router_mask_BxT)
  else:
    h = mlp(p, hn, lcfg)
  return ((x, h) if defer_add else (residual_add(x, h), None)), new_layer, amax, stats


def forward(params, tokens_BxT, cfg: ModelConfig, lcfg: ops.LinearConfig = ops.LinearConfig(), *,
            positions_BxT=None, cache: kvc.KVCache | None = None, kv_scales=None, router_mask_BxT=None,
            residuals: bool = False):
  """Decoder forward -> (hidden_BxTxD after the final norm, new cache or None, ForwardAux).

  ``kv_scales``: (k_scale_L, v_scale_L) to fake-quantize K/V like an FP8 rollout cache (training only; with a
  cache the cache's own scales are used). ``router_mask_BxT``: the tokens that count in the MoE routing statistics
  (padding excluded); all by default. ``residuals``: also return the residual stream in ``ForwardAux.residuals``,
  like transformers' ``output_hidden_states`` ([embeddings, after layer 0, ..., after layer L-1]; diagnostics).
  Logits: ``logits(params, hidden, cfg)``.
  """
  b, t = tokens_BxT.shape
  own_positions = positions_BxT is None and cache is None
  if positions_BxT is None:
    if cache is not None:
      raise ValueError("forward with a KV cache needs positions_BxT (where to write the new tokens)")
    positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  dtype = jnp.dtype(cfg.dtype)
  lcfg = dataclasses.replace(lcfg, out_dtype=cfg.dtype)
  x = embed(params["embed"], tokens_BxT, dtype, lcfg.mesh)
  inv_freq = rope_inv_freq(cfg)

  # The residual add after each layer runs inside the next norm's kernel (decoder_layer's defer_add), except under
  # remat, where a layer's saved input would then be two activations (x and the pending h) instead of one.
  remat = cfg.remat and cache is None
  defer = not remat

  # Every array a layer reads is an argument (none closed over), as remat.checkpoint's custom VJP needs.
  def layer_fn(p, x, h, layer_cache, positions, inv_f, kv_s, router_mask, *, i):
    return decoder_layer(p, x, h, positions, cfg, lcfg, inv_f, layer=i, cache=layer_cache, kv_scales=kv_s,
                         own_positions=own_positions, router_mask_BxT=router_mask, defer_add=defer)

  new_k, new_v, k_amax, v_amax, router, stream = [], [], [], [], [], [x]
  h = None
  for i, p in enumerate(params["layers"]):
    fn = functools.partial(layer_fn, i=i)
    if remat:
      fn = remat_lib.checkpoint(fn)
    (x, h), new_layer, (ka, va), stats = fn(p, x, h, cache, positions_BxT, inv_freq, kv_scales, router_mask_BxT)
    if residuals:
      stream.append(x if h is None else residual_add(x, h))
    k_amax.append(ka)
    v_amax.append(va)
    if stats is not None:
      router.append(stats)
    if new_layer is not None:
      new_k.append(new_layer[0])
      if new_layer[1] is not None:  # an MLA cache holds the latent only (k), no v
        new_v.append(new_layer[1])
  _, x = add_rms_norm(x, h, params["final_norm"], cfg.norm_eps, cfg.norm_backend, lcfg.mesh)
  new_cache = None if cache is None else dataclasses.replace(cache, k=new_k, v=new_v)
  return x, new_cache, ForwardAux(jnp.stack(k_amax), jnp.stack(v_amax), tuple(router),
                                  tuple(stream) if residuals else ())


def logits(params, hidden_BxTxD, cfg: ModelConfig, lcfg: ops.LinearConfig = ops.LinearConfig()):
  """FP32 logits (B, T, V) of the output head (tied to the embedding when cfg.tie_embeddings), computed chunk by
  chunk over the vocabulary as the sampler and the trainer do (``fp8jax.model.head``)."""
  *lead, d = hidden_BxTxD.shape
  lg, _ = head.logits_and_lse(head.head_weight(params, cfg.tie_embeddings), hidden_BxTxD.reshape(-1, d), lcfg)
  return lg.reshape(*lead, lg.shape[-1])


def next_token_logprobs(params, tokens_BxL, cfg: ModelConfig, lcfg: ops.LinearConfig = ops.LinearConfig(), *,
                        temperature: float = 1.0, kv_scales=None, router_mask_BxT=None):
  """The trainer's full-sequence view: (log-prob (B, L-1) of each next token, its entropy, ForwardAux).

  The head is ``head.logprobs_and_entropy``: no (B, L-1, V) logits are held, forward or backward."""
  hidden, _, aux = forward(params, tokens_BxL, cfg, lcfg, kv_scales=kv_scales, router_mask_BxT=router_mask_BxT)
  b, l1 = tokens_BxL.shape[0], tokens_BxL.shape[1] - 1
  lp, ent = head.logprobs_and_entropy(head.head_weight(params, cfg.tie_embeddings),
                                      hidden[:, :-1].reshape(b * l1, -1), tokens_BxL[:, 1:].reshape(-1), lcfg,
                                      temperature)
  return lp.reshape(b, l1), ent.reshape(b, l1), aux


# ------------------------------------------------------------------------------------------------------------------
# Init
# ------------------------------------------------------------------------------------------------------------------


param_shapes = schema.param_shapes


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> dict:
  """Deterministic init, each leaf as its schema row says: ones (norms), zeros (DeepSeek's router bias), N(0, std),
  or N(0, std / sqrt(2 L)) for the projections that write into the residual stream.

  Leaf by leaf (one small jit per shape), so 8B-sized random weights compile in seconds.
  """
  key = jax.random.key(seed)
  shapes = param_shapes(cfg)
  leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
  out = []
  for i, (path, shape) in enumerate(leaves):
    kind = schema.BY_KEY[path[-1].key].init
    if kind in ("ones", "zeros"):
      out.append((jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype))
    else:
      s = std / math.sqrt(2 * cfg.n_layers) if kind == "normal_residual" else std
      out.append(_normal(jax.random.fold_in(key, i), shape, jnp.dtype(dtype), s))
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2))  # random init: rounding mode irrelevant
def _normal_jit(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _normal(key, shape, dtype, std):
  return (_normal_jit(key, shape, dtype) * jnp.asarray(std, dtype)).astype(dtype)
