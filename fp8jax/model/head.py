"""The output head, chunked over the vocabulary: the one definition of logits, log-probs and entropy that the
sampler and the trainer share.

The V logits of a row are computed ``VOCAB_CHUNK`` columns at a time: ``ops.linear`` on rows [start, start + C) of
the head weight (a ``lax.scan`` over the full chunks, then the shorter last chunk). Each chunk's FP32 logits
z = l / temperature are reduced, by one function (``_stats``), to three row statistics

    m_c = max z,   s_c = sum exp(z - m_c),   t_c = sum exp(z - m_c) * z,

and the chunks are combined in chunk order (``_combine``): m = max_c m_c, s = sum_c s_c exp(m_c - m), likewise t;
then logsumexp = m + log s, entropy = logsumexp - t / s and log p(token) = z[token] - logsumexp.

Why chunks:
  * Memory. The trainer (``logprobs_and_entropy``) never holds the (N, V) logits: each chunk is recomputed in the
    backward pass (``jax.checkpoint`` on the scan body), so the head needs O(N x VOCAB_CHUNK) temporaries instead of
    several (N, V) FP32 tensors (16.8 GB each for 8 x 4096 tokens at V = 128256) — the fused linear + cross-entropy
    trick of long-sequence trainers.
  * One engine. The sampler needs all V logits to sample, so ``logits_and_lse`` returns them, but it computes them
    with the same chunked GEMMs (or, on the Hopper kernels, one whole-vocabulary GEMM whose columns are bitwise the
    chunks': ``whole_vocab_gemm``) and the same in-body statistics as the trainer; the token's log-prob is then the
    same arithmetic in decode (N = slots) and in training (N = tokens). A row's bits do not depend on N where the GEMM's
    do not (the Pallas kernels; ``invariant_dot`` on CPU) and every row reduction runs over a fixed C-wide chunk, not
    over a length that follows the batch. Chunking also fixes the GEMM's N (= C) for both callers, which matters on
    XLA:CPU, whose matmul blocking depends on N as well as M.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import ops, quant
from pallas_kernels.core import invariant_sum

# Vocabulary columns per chunk: a multiple of the 128-row weight blocks (so a chunk of a QWeight is whole blocks).
# At 8 x 4096 training tokens a chunk's FP32 logits are 1 GiB. Fixed: the sampler and the trainer must chunk alike.
VOCAB_CHUNK = 8192


def head_weight(params, tie_embeddings: bool):
  """The (V, D) output-head weight: the embedding when tied."""
  return params["embed"] if tie_embeddings else params["lm_head"]


def _rows(w, start, size: int):
  """Rows [start, start + size) of a head weight (array, FP8Weight or QWeight); ``start`` (maybe traced) is a
  multiple of 128, so a QWeight's slice is whole 128 x 128 blocks and its scale rows start at start / 128."""
  if isinstance(w, quant.QWeight):
    return quant.QWeight(lax.dynamic_slice_in_dim(w.q, start, size, 0),
                         lax.dynamic_slice_in_dim(w.scale, start // quant.BLOCK, quant.num_blocks(size), 0))
  if isinstance(w, quant.FP8Weight):
    return quant.FP8Weight(lax.dynamic_slice_in_dim(w.w, start, size, 0))
  return lax.dynamic_slice_in_dim(w, start, size, 0)


def _chunk_logits(h_NxD, w, start, size: int, lcfg: ops.LinearConfig):
  return ops.linear(h_NxD, _rows(w, start, size), dataclasses.replace(lcfg, out_dtype="float32"))


def _stats(z_NxC):
  """(m, s, t) of one chunk of scaled logits (module docstring). m carries no gradient: logsumexp does not depend
  on the shift, so stopping it changes no derivative and keeps max's subgradient out of the backward pass.

  The sums are ``invariant_sum``: with whole-array XLA:CPU reductions a row could round differently at N = slots
  than at N = tokens (seen on the tiny default 2026-12-02 as one FP32 ulp in 5 of 2000 sampled log-probs), and on
  GPUs XLA's fusion autotuner tiled them per shape until ``fp8jax.COMPILER_OPTIONS`` switched it off."""
  m = lax.stop_gradient(jnp.max(z_NxC, axis=-1))
  e = jnp.exp(z_NxC - m[:, None])
  return m, invariant_sum(e), invariant_sum(e * z_NxC)


def _combine(stats):
  """Per-chunk (m, s, t) in chunk order -> (logsumexp, mean of z under softmax(z)), summed in that fixed order."""
  m = stats[0][0]
  for mc, _, _ in stats[1:]:
    m = jnp.maximum(m, mc)
  s = t = None
  for mc, sc, tc in stats:
    r = jnp.exp(mc - m)
    s = sc * r if s is None else s + sc * r
    t = tc * r if t is None else t + tc * r
  return m + jnp.log(s), t / s


def _over_chunks(body, v: int):
  """[body(start, size) for each chunk of a V-long vocabulary], in order: the full chunks in one ``lax.scan``
  (``start`` traced), then the remainder (``start`` static). Outputs are pytrees of arrays."""
  n_full, rem = divmod(v, VOCAB_CHUNK)
  outs = []
  if n_full:
    _, stacked = lax.scan(lambda _, c: (None, body(c * VOCAB_CHUNK, VOCAB_CHUNK)), None, jnp.arange(n_full))
    outs += [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n_full)]
  if rem:
    outs.append(body(n_full * VOCAB_CHUNK, rem))
  return outs


def whole_vocab_gemm(w, lcfg: ops.LinearConfig) -> bool:
  """Whether ``logits_and_lse`` computes all V logits in one GEMM (then takes the chunks' statistics from its
  slices) instead of one GEMM per chunk: where the linear runs on the Hopper kernels (``pallas_kernels.fp8_gemm_mgpu``),
  whose every output element is the same chain of wgmma steps whatever N, the tile config and the element's place
  (that module's docstring, items 3 / 3b; tested bitwise on the GPU), so the whole GEMM's columns [start, start + C)
  are bitwise the chunk's GEMM. It saves per decode step a copy of each chunk's weight rows (the whole head weight:
  ~0.6 ms at 8B, H200) and runs one persistent kernel instead of ~16 one-wave launches. V must be whole 128-blocks
  (the kernel's N), else the chunked path runs: the same bits either way. Elsewhere (XLA:CPU, whose blocking
  follows N) the chunked GEMMs run."""
  return w.shape[0] % quant.BLOCK == 0 and ops.linear_backend(w, lcfg.backend) == "pallas"


def logits_and_lse(w, h_NxD, lcfg: ops.LinearConfig = ops.LinearConfig(), temperature: float = 1.0):
  """The sampler's view: FP32 logits (N, V) (unscaled) and logsumexp (N,) of logits / temperature. Each chunk's
  statistics are computed as in the trainer; the logits come from one GEMM where ``whole_vocab_gemm`` says the bits
  are the chunks' anyway."""
  if whole_vocab_gemm(w, lcfg):
    logits = ops.linear(h_NxD, w, dataclasses.replace(lcfg, out_dtype="float32"))

    def body(start, size):
      return None, _stats(lax.dynamic_slice_in_dim(logits, start, size, 1) / temperature)

    lse, _ = _combine([st for _, st in _over_chunks(body, w.shape[0])])
    return logits, lse

  def body(start, size):
    l = _chunk_logits(h_NxD, w, start, size, lcfg)
    return l, _stats(l / temperature)

  outs = _over_chunks(body, w.shape[0])
  lse, _ = _combine([st for _, st in outs])
  return jnp.concatenate([l for l, _ in outs], axis=-1), lse


def token_logprob(logits_NxV, lse_N, tokens_N, temperature: float = 1.0):
  """log p(token) from ``logits_and_lse``: the trainer's z[token] - logsumexp, the same values and ops."""
  z = jnp.take_along_axis(logits_NxV, tokens_N[:, None], axis=-1)[:, 0] / temperature
  return z - lse_N


def logprobs_and_entropy(w, h_NxD, tokens_N, lcfg: ops.LinearConfig = ops.LinearConfig(), temperature: float = 1.0):
  """The trainer's view: (log p(token) (N,), entropy (N,)) of softmax(h . w^T / temperature), differentiable in
  ``h`` and ``w``, without an (N, V) tensor: each chunk is recomputed in the backward pass."""
  def body(start, size):
    z = _chunk_logits(h_NxD, w, start, size, lcfg) / temperature
    local = tokens_N - start
    inside = (local >= 0) & (local < size)
    z_tok = jnp.take_along_axis(z, jnp.clip(local, 0, size - 1)[:, None], axis=-1)[:, 0]
    return _stats(z), jnp.where(inside, z_tok, 0.0)

  outs = _over_chunks(jax.checkpoint(body, static_argnums=(1,)), w.shape[0])
  lse, mean_z = _combine([st for st, _ in outs])
  z_tok = outs[0][1]
  for _, zt in outs[1:]:  # one chunk holds the token, the others add exact zeros
    z_tok = z_tok + zt
  return z_tok - lse, lse - mean_z


def reference_logprobs_and_entropy(logits_NxV, tokens_N, temperature: float = 1.0):
  """Plain-jnp reference over whole rows (jax.nn.log_softmax): what the chunked head computes, up to rounding."""
  lp = jax.nn.log_softmax(logits_NxV.astype(jnp.float32) / temperature, axis=-1)
  return (jnp.take_along_axis(lp, tokens_N[:, None], axis=-1)[:, 0], -jnp.sum(jnp.exp(lp) * lp, axis=-1))
