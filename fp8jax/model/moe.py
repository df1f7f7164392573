"""The MoE blocks: Qwen3-MoE (transformers' Qwen3MoeSparseMoeBlock) and DeepSeek-V3 (DeepseekV3MoE): a BF16/FP32
router and block-FP8 SwiGLU experts.

Per token: router logits ``x . router^T`` (a BF16 GEMM: the router is not a recipe linear, so it is never
quantized), probabilities ``softmax`` in FP32 over all experts, the ``k`` largest (``lax.top_k``), renormalized
when ``norm_topk_prob``, cast to the activation dtype. The token's ``k`` (token, expert) assignments are sorted by
expert (a stable sort, so the order is a function of the routing alone) and gathered once into the grouped GEMM's
tile layout (each expert's rows from a 128-row boundary), where the experts run as three grouped GEMMs
(``ops.grouped_linear_tiles``: each expert's rows are a dense block-FP8 GEMM of their own, bitwise what
``ops.linear`` gives those rows), then each assignment's output is gathered back in token order, weighted in FP32
(exact: a product of two BF16 values) and the ``k`` of a token are added in FP32 one slot after the other, rounded
to BF16 once. The combine has no scatter-add (deterministic on every backend) and no reduce over the k slots: with
``jnp.sum`` (and the product in BF16) the decode step's rows came out one BF16 ulp off the training rows on CPU, the
compiled combine differing with the shape. transformers multiplies in BF16 and adds into a BF16 buffer expert by expert
instead; the two differ by BF16 rounding only (tests/test_moe.py).

DeepSeek-V3 (``cfg.moe_router == "sigmoid"``, transformers' DeepseekV3TopkRouter, ``noaux_tc``): the router's
logits are FP32 (BF16 operands, FP32 output), scores = sigmoid(logits); the choice adds the correction bias
(``router_bias``, FP32, no gradient: DeepSeek updates it by a load rule, not by the loss); with ``n_group > 1`` only
the ``topk_group`` groups whose two best biased scores sum highest stay eligible; the k best eligible experts are
chosen; their *unbiased* scores, renormalized when ``norm_topk_prob`` (sum + 1e-20), times
``routed_scaling_factor``, are the FP32 weights. The shared experts (a SwiGLU MLP every token passes) are added to
the routed output in the activation dtype, as transformers does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp8jax import ops, sharding
from fp8jax.model import experts, moe_parallel
from fp8jax.model.config import ModelConfig
from fp8jax.model.mlp import mlp
from pallas_kernels.core import pairwise_max, pairwise_sum


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
  """What a MoE layer's routing did, for the load-balancing loss and for metrics."""

  expert_ids_BxTxK: jax.Array  # int32, the chosen experts of every token, best first
  counts_E: jax.Array  # FP32, assignments per expert (masked tokens excluded)
  prob_sums_E: jax.Array  # FP32, sum over (unmasked) tokens of the router probabilities
  rows: jax.Array  # FP32, number of (unmasked) tokens


def route(p, x_MxD, cfg: ModelConfig, lcfg: ops.LinearConfig):
  """(weights (M, k) in x's dtype (FP32 for the sigmoid router), expert ids (M, k) int32, probabilities (M, E)
  FP32: the softmax, or the sigmoid scores normalized to sum 1, for the statistics)."""
  if cfg.moe_router == "sigmoid":
    return _route_sigmoid(p, x_MxD, cfg, lcfg)
  logits = ops.linear(x_MxD, p["router"], lcfg)
  probs = _softmax(logits.astype(jnp.float32))
  top_p, top_i = jax.lax.top_k(probs, cfg.n_experts_per_tok)
  if cfg.norm_topk_prob:
    top_p = top_p / pairwise_sum(top_p)[:, None]
  return top_p.astype(x_MxD.dtype), top_i.astype(jnp.int32), probs


def _softmax(z_MxE):
  """``jax.nn.softmax`` over experts with no reduce in it, on every backend: the max (no gradient: the softmax does
  not depend on the shift) and the denominator as elementwise ops in one fixed order (``pairwise_max``,
  ``pairwise_sum``). With jax.nn.softmax, XLA:CPU gave the same token's probabilities other FP32 roundings among 512
  training tokens than among 4 decode rows (``exp`` fused after the row max compiles per shape), so routing weights
  and then the whole residual stream of sampler and trainer parted (tests/test_moe.py, 128-token sequences)."""
  e = jnp.exp(z_MxE - jax.lax.stop_gradient(pairwise_max(z_MxE))[:, None])
  return e / pairwise_sum(e)[:, None]


def _route_sigmoid(p, x_MxD, cfg: ModelConfig, lcfg: ops.LinearConfig):
  logits = ops.linear(x_MxD, p["router"], dataclasses.replace(lcfg, out_dtype="float32"))
  scores = jax.nn.sigmoid(logits.astype(jnp.float32))
  choice = scores + jax.lax.stop_gradient(p["router_bias"]).astype(jnp.float32)
  if cfg.n_group > 1:
    m, per = choice.shape[0], cfg.n_experts // cfg.n_group
    grouped = choice.reshape(m, cfg.n_group, per)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (M, G)
    _, best = jax.lax.top_k(group_scores, cfg.topk_group)
    keep = jnp.zeros((m, cfg.n_group), bool).at[jnp.arange(m)[:, None], best].set(True)
    choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(m, cfg.n_experts)
  _, top_i = jax.lax.top_k(choice, cfg.n_experts_per_tok)
  w = jnp.take_along_axis(scores, top_i, axis=-1)
  if cfg.norm_topk_prob:
    w = w / (pairwise_sum(w)[:, None] + 1e-20)  # a fixed order, as _softmax's sum
  w = w * jnp.float32(cfg.routed_scaling_factor)
  return w, top_i.astype(jnp.int32), scores / jnp.sum(scores, axis=-1, keepdims=True)


def expert_rows(p, x_MxD, experts_Mxk, cfg: ModelConfig, lcfg: ops.LinearConfig):
  """Each assignment's expert output -> (M * k, D) in x's dtype, row a = token a // k, slot a % k. On a multi-device
  mesh the experts run per device, split over its ``expert`` axis (``moe_parallel``: the same rows bit for bit)."""
  if sharding.multi_device(lcfg.mesh):
    return moe_parallel.expert_rows(p, x_MxD, experts_Mxk, cfg, lcfg)
  return experts.local_expert_rows(p, x_MxD, experts_Mxk, cfg.n_experts, lcfg)


def moe(p, x_BxTxD, cfg: ModelConfig, lcfg: ops.LinearConfig, mask_BxT=None):
  """The MoE MLP -> (out (B, T, D) in x's dtype, RouterStats). ``mask_BxT``: tokens that count in the stats."""
  b, t, d = x_BxTxD.shape
  k, n_exp = cfg.n_experts_per_tok, cfg.n_experts
  x = x_BxTxD.reshape(b * t, d)
  weights_Mxk, experts_Mxk, probs_MxE = route(p, x, cfg, lcfg)
  flat = experts_Mxk.reshape(-1)  # assignment a = token * k + slot
  # exact for the softmax router's BF16 weights (BF16 x BF16 fits FP32); the sigmoid router's are FP32 already
  y = expert_rows(p, x, experts_Mxk, cfg, lcfg).reshape(b * t, k, d).astype(jnp.float32) * weights_Mxk.astype(
      jnp.float32)[..., None]
  out = experts.sum_slots(y).astype(x.dtype).reshape(b, t, d)
  if cfg.n_shared_experts:
    out = out + mlp(p, x_BxTxD, lcfg, prefix="shared_")

  m = jnp.ones((b * t,), jnp.float32) if mask_BxT is None else mask_BxT.reshape(-1).astype(jnp.float32)
  counts = jnp.zeros((n_exp,), jnp.float32).at[flat].add(jnp.repeat(m, k))
  stats = RouterStats(experts_Mxk.reshape(b, t, k), counts, jnp.sum(probs_MxE * m[:, None], axis=0), jnp.sum(m))
  return out, stats


def load_balancing_loss(stats: list[RouterStats], n_experts: int) -> jax.Array:
  """Switch-Transformer auxiliary loss over all MoE layers, as transformers' ``load_balancing_loss_func``:
  ``E * sum_e (assignments_e / rows) * (probability mass_e / rows)``, with the counts and masses summed over the
  layers and ``rows`` = layers x tokens. Balanced routing gives k; 0.0 without MoE layers or counted tokens."""
  if not stats:
    return jnp.float32(0.0)
  rows = jnp.maximum(sum(s.rows for s in stats), 1.0)
  counts = sum(s.counts_E for s in stats) / rows
  probs = sum(s.prob_sums_E for s in stats) / rows
  return n_experts * jnp.sum(counts * probs)
