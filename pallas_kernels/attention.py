"""Causal GQA attention over 128-key blocks with an online softmax: the numerics contract and its plain-jnp reference.

Operands (one layout for training, prefill and decode):
  q_BxTxHxD      queries (BF16), T query rows per sequence at positions ``q_pos_BxT`` (-1: a padding row).
  k_BxSxKxD      keys: BF16 values, or E4M3 codes (BF16 holding code values, or float8_e4m3fn read from an FP8 cache).
  v_BxSxKxD      values, the same forms. The key/value at index j has position j.
  qk_scale       FP32 scalar multiplied into every raw dot q.k (the caller's k_scale / sqrt(D) * log2(e): scores
                 are kept in log2 units, so the softmax uses exp2).
  v_scale        FP32 scalar multiplied into the output (the FP8 cache's V scale; 1 for BF16 values).
  H = G * K: query head h reads key/value head h // G.
A query row at position p sees keys j <= p.

Math (the contract every backend follows, so that a row's result does not depend on anything but its own query,
its position and the keys it sees):
  for key block n = 0, 1, ... in increasing order, with blocks of BLOCK_KV = 128 keys [128 n, 128 n + 128),
  as long as 128 n <= p (later blocks are not visited at all):
    s   = (q . k_j) * qk_scale  for j in the block, FP32 dots of BF16 operands; -inf where j > p
    m'  = max(m, max_j s);  m0 = m' (0 if m' = -inf)
    l   = l * exp2(m - m0) + sum_j exp2(s - m0)
    acc = acc * exp2(m - m0) + dot(bf16(exp2(s - m0)), v)        (FP32 accumulation)
    m   = m'
  out = bf16(acc * (v_scale / l))  (0 where l = 0: a row that sees no key);  lse = m + log2(l) (log2 units).
Nothing depends on how many rows, heads, sequences or slots are computed together or on the key length S beyond
the row's own blocks: no split over keys, no shape-dependent block size. So a decode row (one query over a slot's
cache) and the training row at the same position (a sequence of queries over their own keys) run the same
sequence of updates on the same numbers, and agree bit for bit wherever the backend computes each row with
shape-independent instructions (the Pallas kernels by construction: one kernel body and tile shape for both;
XLA:CPU in tests/test_attention.py). Values at keys j > p enter only multiplied by 0; the V rows past a tile's
last visible key are zeroed so that stale cache rows (even NaN) cannot leak into a row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

BLOCK_KV = 128
LOG2E = math.log2(math.e)


def check_operands(q, k, v, q_pos):
  """Shape/dtype checks shared by the reference and the kernels; raises naming the offending shapes."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"attention takes q (B, T, H, D), k/v (B, S, K, D); got q {q.shape}, k {k.shape}, v {v.shape}")
  b, t, h, d = q.shape
  if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"attention: k {k.shape} and v {v.shape} must both be (B={b}, S, K, D={d}) for q {q.shape}")
  if h % k.shape[2]:
    raise ValueError(f"attention: {h} query heads are not a multiple of {k.shape[2]} key/value heads (q {q.shape}, "
                     f"k {k.shape})")
  if q_pos.shape != (b, t):
    raise ValueError(f"attention: q_pos must be (B, T) = {(b, t)}, got {tuple(q_pos.shape)}")
  for name, x in (("k", k), ("v", v)):
    if x.dtype not in (jnp.dtype(q.dtype), jnp.dtype(jnp.float8_e4m3fn)):
      raise ValueError(f"attention: {name} must be {jnp.dtype(q.dtype)} (q's dtype) or float8_e4m3fn, got {x.dtype}")


def pad_keys(x_BxSxKxD, block: int = BLOCK_KV):
  """Zero-pads the key axis to a multiple of ``block`` (padding keys are never visible: index > every position)."""
  s = x_BxSxKxD.shape[1]
  sp = -(-s // block) * block
  return x_BxSxKxD if sp == s else jnp.pad(x_BxSxKxD, ((0, 0), (0, sp - s), (0, 0), (0, 0)))


ROW_TILE = 16  # rows per fixed-shape tile of the CPU reference (see attention_reference)


def _block_update(carry, q_RxD, kb_NxD, vb_NxD, start, pos_R, last, qk_scale):
  """One key block [start, start + N) of the contract's online softmax for rows (..., R) sharing the keys (..., N).

  ``last``: the largest position among rows sharing these keys (V rows past it are zeroed: stale cache rows).
  """
  m, l, acc = carry
  dtype = q_RxD.dtype
  key = start + jnp.arange(kb_NxD.shape[-2], dtype=jnp.int32)
  vb = jnp.where((key <= last[..., None])[..., :, None], vb_NxD.astype(dtype), jnp.zeros((), dtype))
  s = jnp.einsum("...rd,...nd->...rn", q_RxD, kb_NxD.astype(dtype), preferred_element_type=jnp.float32) * qk_scale
  s = jnp.where(key <= pos_R[..., :, None], s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m0 = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m0)
  p = jnp.exp2(s - m0[..., None])
  l_new = l * alpha + jnp.sum(p, axis=-1)
  acc_new = acc * alpha[..., None] + jnp.einsum("...rn,...nd->...rd", p.astype(dtype), vb,
                                                preferred_element_type=jnp.float32)
  active = start <= pos_R  # blocks after a row's own are not visited
  return jnp.where(active, m_new, m), jnp.where(active, l_new, l), jnp.where(active[..., None], acc_new, acc)


def _attend_rows(q_RxD, k_NbxbkxD, v_NbxbkxD, pos_R, last, qk_scale):
  """Rows (..., R) over key blocks (Nb, ..., bk, D) in order -> (m, l, acc) of the contract."""
  lead, (r, d) = q_RxD.shape[:-2], q_RxD.shape[-2:]
  bk = k_NbxbkxD.shape[-2]

  def body(carry, xs):
    n, kb, vb = xs
    return _block_update(carry, q_RxD, kb, vb, n * bk, pos_R, last, qk_scale), None

  init = (jnp.full((*lead, r), -jnp.inf, jnp.float32), jnp.zeros((*lead, r), jnp.float32),
          jnp.zeros((*lead, r, d), jnp.float32))
  nb = k_NbxbkxD.shape[0]
  return jax.lax.scan(body, init, (jnp.arange(nb, dtype=jnp.int32), k_NbxbkxD, v_NbxbkxD))[0]


def attention_reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, qk_scale, v_scale, *, block_kv: int = BLOCK_KV):
  """The contract in plain jnp (module docstring) -> (out_BxTxHxD in q's dtype, lse_BxHxT FP32 in log2 units).

  Rows are the (position, head) pairs of each (sequence, key/value head). On XLA:CPU they are cut into fixed-shape
  tiles of ROW_TILE rows, and one ``lax.map`` body (a tile's loop over its key blocks) computes every tile, so every
  row goes through the same compiled code whatever the batch, the number of rows or the key length: decode rows
  equal training rows bit for bit (tests/test_attention.py). Vectorizing over all rows instead lets XLA:CPU pick its
  code by the whole shape (seen: one row in ~90k a BF16 ulp off, a 4 x 700 batch); letting producers fuse into the
  reductions changes their rounding per fusion (seen: 40% of a 3-layer model's hidden values). Elsewhere (GPUs,
  where the kernels provide the invariance) all rows are vectorized. Differentiable by JAX autodiff: the independent
  reference for the kernels' backward pass. It keeps each block's scores for the backward, so it is for tests, CPU
  runs and fallbacks, not for 4096-token training on a GPU.
  """
  check_operands(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT)
  b, t, h, d = q_BxTxHxD.shape
  n_kv = k_BxSxKxD.shape[2]
  g, r = h // n_kv, t * (h // n_kv)
  dtype = q_BxTxHxD.dtype
  k, v = pad_keys(k_BxSxKxD, block_kv), pad_keys(v_BxSxKxD, block_kv)
  nb = k.shape[1] // block_kv
  q_BxKxRxD = q_BxTxHxD.reshape(b, t, n_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n_kv, r, d)
  pos = q_pos_BxT.astype(jnp.int32)
  pos_BxR = jnp.repeat(pos, g, axis=1)
  last_B = jnp.max(pos, axis=1)
  qk_scale = jnp.asarray(qk_scale, jnp.float32)
  kb, vb = (x.reshape(b, nb, block_kv, n_kv, d).transpose(1, 0, 3, 2, 4) for x in (k, v))  # (Nb, B, K, bk, D)
  if jax.default_backend() != "cpu":
    m, l, acc = _attend_rows(q_BxKxRxD, kb, vb, pos_BxR[:, None], last_B[:, None], qk_scale)
  else:
    rp = -(-r // ROW_TILE) * ROW_TILE
    nt = rp // ROW_TILE
    q_t = jnp.pad(q_BxKxRxD, ((0, 0), (0, 0), (0, rp - r), (0, 0))).reshape(b * n_kv * nt, ROW_TILE, d)
    pos_t = jnp.broadcast_to(jnp.pad(pos_BxR, ((0, 0), (0, rp - r)), constant_values=-1).reshape(b, 1, nt, ROW_TILE),
                             (b, n_kv, nt, ROW_TILE)).reshape(-1, ROW_TILE)
    tile_b = jnp.repeat(jnp.arange(b, dtype=jnp.int32), n_kv * nt)
    tile_k = jnp.tile(jnp.repeat(jnp.arange(n_kv, dtype=jnp.int32), nt), b)

    def tile(xs):
      q1, p1, bi, ki = xs
      return _attend_rows(q1, kb[:, bi, ki], vb[:, bi, ki], p1, last_B[bi], qk_scale)

    m, l, acc = jax.lax.map(tile, (q_t, pos_t, tile_b, tile_k))
    m, l = (x.reshape(b, n_kv, rp)[..., :r] for x in (m, l))
    acc = acc.reshape(b, n_kv, rp, d)[..., :r, :]
  seen = l > 0
  inv = jnp.where(seen, jnp.asarray(v_scale, jnp.float32) / jnp.where(seen, l, 1.0), 0.0)
  out = (acc * inv[..., None]).astype(dtype).reshape(b, n_kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
  lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf).reshape(b, n_kv, t, g)
  return out, lse.transpose(0, 1, 3, 2).reshape(b, h, t)


def attention_dense(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, qk_scale, v_scale):
  """Textbook softmax attention in FP32 (all keys at once): the independent check of the blocked math."""
  b, t, h, d = q_BxTxHxD.shape
  n_kv = k_BxSxKxD.shape[2]
  g = h // n_kv
  q = q_BxTxHxD.astype(jnp.float32).reshape(b, t, n_kv, g, d)
  k, v = k_BxSxKxD.astype(jnp.float32), v_BxSxKxD.astype(jnp.float32)
  s = jnp.einsum("btkgd,bskd->btkgs", q, k, precision=jax.lax.Precision.HIGHEST) * (qk_scale / LOG2E)
  vis = jnp.arange(k.shape[1])[None, None, :] <= q_pos_BxT[:, :, None]
  s = jnp.where(vis[:, :, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(jnp.any(vis, -1)[:, :, None, None, None], p, 0.0)
  out = jnp.einsum("btkgs,bskd->btkgd", p, v, precision=jax.lax.Precision.HIGHEST) * v_scale
  return out.reshape(b, t, h, d)
