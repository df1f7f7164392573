"""Causal GQA attention over fixed key blocks with an online softmax: the numerics contract and its plain-jnp reference.

Operands (one layout for training, prefill and decode):
  q_BxTxHxD      queries (BF16), T query rows per sequence at positions ``q_pos_BxT`` (-1: a padding row).
  k_BxSxKxD      keys: BF16 values, or E4M3 codes (float8_e4m3fn read from an FP8 cache, or the code values held
                 in BF16 or FP16: exact; the caller says ``kv_codes``).
  v_BxSxKxD      values, the same forms. The key/value at index j has position j.
  qk_scale       FP32 scalar multiplied into every raw dot q.k (the caller's k_scale / sqrt(D) * log2(e): scores
                 are kept in log2 units, so the softmax uses exp2).
  v_scale        FP32 scalar multiplied into the output (the FP8 cache's V scale; 1 for BF16 values).
  H = G * K: query head h reads key/value head h // G.
A query row at position p sees keys j <= p.
Paged form (the sampler's paged KV cache, ``fp8jax.kvcache``): k/v are pools of pages (N, bk, K, D), one page per
key block, and ``page_table_BxNb`` names the page that holds keys [bk n, bk n + bk) of sequence b. The page size is
the key block, so a paged row visits the same blocks in the same order as a dense row over the same keys: same bits.

Math (the contract every backend follows, so that a row's result does not depend on anything but its own query,
its position and the keys it sees):
  for key block n = 0, 1, ... in increasing order, with blocks of bk keys [bk n, bk n + bk), as long as bk n <= p
  (later blocks are not visited at all); bk is fixed per backend (``key_block``): BLOCK_KV = 128 for the GPU
  kernels, CPU_BLOCK_KV = 16 for the CPU reference (invariance needs a fixed block, not a particular one):
    s   = (q . k_j) * qk_scale  for j in the block, FP32 dots of BF16 operands (of FP16 operands for E4M3 codes,
          below); -inf where j > p
    m'  = max(m, max_j s);  m0 = m' (0 if m' = -inf)
    l   = l * exp2(m - m0) + sum_j exp2(s - m0)
    acc = acc * exp2(m - m0) + dot(bf16(exp2(s - m0)), v)        (FP32 accumulation; fp16(...) for codes)
    m   = m'
  out = bf16(acc * (v_scale / l))  (0 where l = 0: a row that sees no key);  lse = m + log2(l) (log2 units).
E4M3 codes (the FP8 KV recipe) take FP16 dot operands: the codes are exact in FP16, Q is clipped to +-65504 and
rounded to FP16 (exact for BF16 Q in FP16's normal range), P rounds to FP16 (3 more bits than BF16 in [2^-14, 1]).
Why: on the GPU, E4M3 -> FP16 is one conversion per pair, E4M3 -> BF16 goes through FP32; the FP8 decode tile is
bound by that upcast, and FP16 operands run it 1.18x faster (docs/history.md, 2026-12-03).
The GPU kernels evaluate exp2(s - m0) as 2**fma(q . k, qk_scale, -m0) with an approximate EX2 (flush to zero
below 2**-126), take sum_j in fixed point (each term rounded to a multiple of 2**-22, added as integers: exact, so
in no particular order; within ~1e-6 of the FP32 sum) and, for E4M3 codes, q . k as the sum of two half-D dots
(``pallas_kernels.attention_triton``; the GPU tests hold them to this reference within BF16
rounding of the outputs and 1e-4 on the row lse); the reference stays the definition, and every caller of a
backend runs the same code, which is what keeps its rows bitwise equal.
Nothing depends on how many rows, heads, sequences or slots are computed together or on the key length S beyond
the row's own blocks: no split over keys, no shape-dependent block size. So a decode row (one query over a slot's
cache) and the training row at the same position (a sequence of queries over their own keys) run the same
sequence of updates on the same numbers, and agree bit for bit wherever the backend computes each row with
shape-independent instructions (the Pallas kernels: one kernel body, tile-independent dots, an exact row sum;
XLA:CPU: one fixed-shape body for every row, ``attention_reference``; tests/test_attention.py). Values at keys j > p enter only multiplied by 0; the V rows past a tile's
last visible key are zeroed so that stale cache rows (even NaN) cannot leak into a row.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

BLOCK_KV = 128
LOG2E = math.log2(math.e)


def key_block() -> int:
  """The key block of this backend's attention: BLOCK_KV for the kernels (GPUs), CPU_BLOCK_KV for the CPU reference.

  KV caches are allocated in whole blocks of this size (``fp8jax.kvcache.padded_len``)."""
  return CPU_BLOCK_KV if jax.default_backend() == "cpu" else BLOCK_KV


def check_operands(q, k, v, q_pos, page_table=None, block_kv: int | None = None):
  """Shape/dtype checks shared by the reference and the kernels; raises naming the offending shapes.

  ``page_table`` (B, Nb) int32: k/v are page pools (N, block_kv, K, D) (the paged form, module docstring)."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"attention takes q (B, T, H, D), k/v (B, S, K, D); got q {q.shape}, k {k.shape}, v {v.shape}")
  b, t, h, d = q.shape
  if page_table is not None:
    bk = block_kv or key_block()
    if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
      raise ValueError(f"attention: page_table must be integer (B={b}, pages per sequence), got "
                       f"{page_table.dtype}{tuple(page_table.shape)} for q {q.shape}")
    if k.shape != v.shape or k.shape[1] != bk or k.shape[3] != d:
      raise ValueError(f"attention: paged k {k.shape} and v {v.shape} must both be (pages, {bk} (the key block), K, "
                       f"D={d}) for q {q.shape}")
  elif k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
    raise ValueError(f"attention: k {k.shape} and v {v.shape} must both be (B={b}, S, K, D={d}) for q {q.shape}")
  if h % k.shape[2]:
    raise ValueError(f"attention: {h} query heads are not a multiple of {k.shape[2]} key/value heads (q {q.shape}, "
                     f"k {k.shape})")
  if q_pos.shape != (b, t):
    raise ValueError(f"attention: q_pos must be (B, T) = {(b, t)}, got {tuple(q_pos.shape)}")
  for name, x in (("k", k), ("v", v)):
    if x.dtype not in (jnp.dtype(q.dtype), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float16)):
      raise ValueError(f"attention: {name} must be {jnp.dtype(q.dtype)} (q's dtype), or E4M3 codes as float8_e4m3fn or "
                       f"float16, got {x.dtype}")
  if k.dtype != v.dtype:
    raise ValueError(f"attention: k and v must have one dtype, got k {k.dtype} and v {v.dtype}")


def pair_order(x):
  """A K/V row's head dims in pair order (the FP8 cache's layout): position 2i holds dim i, 2i + 1 holds dim
  i + D/2, so that each 16-bit pair holds one value of each head-dim half (``attention_triton._load_block`` says
  why). A permutation of the last axis: exact, and ``natural_order`` undoes it."""
  *lead, d = x.shape
  return jnp.swapaxes(x.reshape(*lead, 2, d // 2), -1, -2).reshape(x.shape)


def natural_order(x):
  """The inverse of ``pair_order``."""
  *lead, d = x.shape
  return jnp.swapaxes(x.reshape(*lead, d // 2, 2), -1, -2).reshape(x.shape)


def pad_keys(x_BxSxKxD, block: int):
  """Zero-pads the key axis to a multiple of ``block`` (padding keys are never visible: index > every position)."""
  s = x_BxSxKxD.shape[1]
  sp = -(-s // block) * block
  return x_BxSxKxD if sp == s else jnp.pad(x_BxSxKxD, ((0, 0), (0, sp - s), (0, 0), (0, 0)))


CPU_BLOCK_KV = 16  # the CPU reference's key block (attention_reference)
TILE_ROWS = 256  # rows per step of the CPU reference's lax.map


FP16_MAX = 65504.0


@jax.custom_jvp
def fp16_round(x):
  """FP32 values rounded to FP16 (clipped to its range), kept in FP32; the gradient passes straight through in FP32
  (so no cotangent is ever held in FP16). The contract's FP16 operands for E4M3 codes: an FP32 dot of these values
  is the FP16-operand dot (products of FP16 values are exact in FP32; TF32 holds FP16 values exactly too)."""
  return jnp.clip(x.astype(jnp.float32), -FP16_MAX, FP16_MAX).astype(jnp.float16).astype(jnp.float32)


fp16_round.defjvps(lambda g, ans, x: g.astype(jnp.float32))


def _block_update(carry, q_RxD, kb_NxD, vb_NxD, start, pos_R, last, qk_scale):
  """One key block [start, start + N) of the contract's online softmax for rows (..., R) sharing the keys (..., N).

  ``last``: the largest position among rows sharing these keys (V rows past it are zeroed: stale cache rows).
  Q in FP32 means the FP16-operand form (E4M3 codes; ``q`` already ``fp16_round``-ed): P is rounded to FP16 too.
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
  pd = fp16_round(p) if dtype == jnp.float32 else p.astype(dtype)
  acc_new = acc * alpha[..., None] + jnp.einsum("...rn,...nd->...rd", pd, vb,
                                                preferred_element_type=jnp.float32)
  active = start <= pos_R  # blocks after a row's own are not visited
  return jnp.where(active, m_new, m), jnp.where(active, l_new, l), jnp.where(active[..., None], acc_new, acc)


def _attend_rows(q_RxD, k_NbxbkxD, v_NbxbkxD, pos_R, last, qk_scale):
  """Rows (..., R) over every key block (Nb, ..., bk, D) in order -> (m, l, acc) of the contract (differentiable)."""
  lead, (r, d) = q_RxD.shape[:-2], q_RxD.shape[-2:]
  bk = k_NbxbkxD.shape[-2]

  def body(carry, xs):
    n, kb, vb = xs
    return _block_update(carry, q_RxD, kb, vb, n * bk, pos_R, last, qk_scale), None

  nb = k_NbxbkxD.shape[0]
  return jax.lax.scan(body, _init(lead, r, d), (jnp.arange(nb, dtype=jnp.int32), k_NbxbkxD, v_NbxbkxD))[0]


def _init(lead, r, d):
  return (jnp.full((*lead, r), -jnp.inf, jnp.float32), jnp.zeros((*lead, r), jnp.float32),
          jnp.zeros((*lead, r, d), jnp.float32))


def _attend_rows_tiled(q_BxKxRxD, k_pages, v_pages, table_BxNb, pos_BxR, last_B, qk_scale, g: int):
  """The same (m, l, acc), forward only, with every row computed by one fixed-shape body (XLA:CPU exactness).

  Keys come as pages (N, bk, K, D) and a page table (B, Nb) (a dense cache is the table b * Nb + n).
  Tiles are the G rows (heads) of one (sequence, key/value head, position); a ``lax.map`` step computes
  TILE_ROWS // G of them, the tile count padded with empty tiles so that every step is full; in a step the key
  blocks run up to the step's last position only (later blocks would be skipped by every row anyway).
  """
  b, n_kv, r, d = q_BxKxRxD.shape
  n = max(1, TILE_ROWS // g)
  nt = b * n_kv * (r // g)
  pad = -(-nt // n) * n - nt
  q_t = jnp.pad(q_BxKxRxD.reshape(nt, g, d), ((0, pad), (0, 0), (0, 0))).reshape(-1, n, g, d)
  pos_t = jnp.pad(jnp.broadcast_to(pos_BxR[:, None], (b, n_kv, r)).reshape(nt, g), ((0, pad), (0, 0)),
                  constant_values=-1).reshape(-1, n, g)
  tb = jnp.pad(jnp.repeat(jnp.arange(b, dtype=jnp.int32), n_kv * (r // g)), (0, pad)).reshape(-1, n)
  tk = jnp.pad(jnp.tile(jnp.repeat(jnp.arange(n_kv, dtype=jnp.int32), r // g), b), (0, pad)).reshape(-1, n)
  bk, nb = k_pages.shape[1], table_BxNb.shape[1]

  def step(xs):
    q1, p1, bi, ki = xs
    pages = table_BxNb[bi].T  # (Nb, n): the step's sequences' pages, block by block
    kbt, vbt, last = k_pages[pages, :, ki], v_pages[pages, :, ki], last_B[bi]  # (Nb, n, bk, D)
    blocks = jnp.clip(jax.lax.div(jnp.max(p1) + bk, bk), 0, nb)
    return jax.lax.fori_loop(0, blocks, lambda j, c: _block_update(c, q1, kbt[j], vbt[j], j * bk, p1, last,
                                                                   qk_scale), _init((n,), g, d))

  m, l, acc = jax.lax.map(step, (q_t, pos_t, tb, tk))
  return m.reshape(-1, g)[:nt].reshape(b, n_kv, r), l.reshape(-1, g)[:nt].reshape(b, n_kv, r), \
      acc.reshape(-1, g, d)[:nt].reshape(b, n_kv, r, d)


def _finish(m, l, acc, v_scale, dtype, b, t, h, g):
  n_kv, d = h // g, acc.shape[-1]
  seen = l > 0
  inv = jnp.where(seen, jnp.asarray(v_scale, jnp.float32) / jnp.where(seen, l, 1.0), 0.0)
  out = (acc * inv[..., None]).astype(dtype).reshape(b, n_kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
  lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf).reshape(b, n_kv, t, g)
  return out, lse.transpose(0, 1, 3, 2).reshape(b, h, t)


def as_pages(x_BxSxKxD, block: int):
  """A dense (B, S, K, D) cache as (pages (B * Nb, block, K, D), page table (B, Nb)): the paged form of the same keys."""
  x = pad_keys(x_BxSxKxD, block)
  b, s, n_kv, d = x.shape
  nb = s // block
  return x.reshape(b * nb, block, n_kv, d), jnp.arange(b * nb, dtype=jnp.int32).reshape(b, nb)


def dense_view(pages_NxPxKxD, table_BxNb):
  """The (B, Nb * P, K, D) keys a page table names (a gathered copy)."""
  x = pages_NxPxKxD[table_BxNb]
  b, nb, p, n_kv, d = x.shape
  return x.reshape(b, nb * p, n_kv, d)


def is_codes(k, kv_codes: bool) -> bool:
  """Whether K/V are E4M3 codes (the FP16-operand form): said by the caller, or implied by an FP8 / FP16 dtype."""
  return bool(kv_codes) or jnp.dtype(k.dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float16))


def _reference(q_BxTxHxD, k, v, q_pos_BxT, qk_scale, v_scale, block_kv: int, tiled: bool, table=None, codes=False):
  b, t, h, d = q_BxTxHxD.shape
  n_kv = k.shape[2]
  g, r = h // n_kv, t * (h // n_kv)
  qo = fp16_round(q_BxTxHxD) if codes else q_BxTxHxD  # FP32 holding FP16 values: the FP16-operand form
  q_BxKxRxD = qo.reshape(b, t, n_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n_kv, r, d)
  pos = q_pos_BxT.astype(jnp.int32)
  pos_BxR, last_B = jnp.repeat(pos, g, axis=1), jnp.max(pos, axis=1)
  qk_scale = jnp.asarray(qk_scale, jnp.float32)
  if tiled:
    (k, tab), (v, _) = ((x, table) if table is not None else as_pages(x, block_kv) for x in (k, v))
    m, l, acc = _attend_rows_tiled(q_BxKxRxD, k, v, tab, pos_BxR, last_B, qk_scale, g)
  else:
    if table is not None:
      k, v = dense_view(k, table), dense_view(v, table)
    k, v = pad_keys(k, block_kv), pad_keys(v, block_kv)
    nb = k.shape[1] // block_kv
    kb, vb = (x.reshape(b, nb, block_kv, n_kv, d).transpose(1, 0, 3, 2, 4) for x in (k, v))  # (Nb, B, K, bk, D)
    m, l, acc = _attend_rows(q_BxKxRxD, kb, vb, pos_BxR[:, None], last_B[:, None], qk_scale)
  return _finish(m, l, acc, v_scale, q_BxTxHxD.dtype, b, t, h, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _reference_cpu(q, k, v, pos, qk_scale, v_scale, block_kv, codes):
  return _reference(q, k, v, pos, qk_scale, v_scale, block_kv, tiled=True, codes=codes)


def _reference_cpu_fwd(q, k, v, pos, qk_scale, v_scale, block_kv, codes):
  return _reference_cpu(q, k, v, pos, qk_scale, v_scale, block_kv, codes), (q, k, v, pos, qk_scale, v_scale)


def _reference_cpu_bwd(block_kv, codes, res, cts):
  q, k, v, pos, qk_scale, v_scale = res
  _, vjp = jax.vjp(lambda q, k, v, a, c: _reference(q, k, v, pos, a, c, block_kv, tiled=False, codes=codes), q, k, v,
                   qk_scale, v_scale)
  return (*vjp(cts)[:3], None, *vjp(cts)[3:])


_reference_cpu.defvjp(_reference_cpu_fwd, _reference_cpu_bwd)


def attention_reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, qk_scale, v_scale, *, block_kv: int | None = None,
                        page_table_BxNb=None, kv_codes: bool = False):
  """The contract in plain jnp (module docstring) -> (out_BxTxHxD in q's dtype, lse_BxHxT FP32 in log2 units).

  Rows are the (position, head) pairs of each (sequence, key/value head). On GPUs (where the kernels provide the
  invariance) all rows are vectorized over 128-key blocks. On XLA:CPU, the exactness backend, the forward computes
  every row with one fixed-shape ``lax.map`` body (``_attend_rows_tiled``) over CPU_BLOCK_KV-key blocks, so that a
  row gets the same bits whatever the batch, the number of rows or the key length: decode rows equal training rows
  (tests/test_attention.py). Vectorized over all rows, XLA:CPU picks its code by the whole shape (seen: one row in
  ~90k a BF16 ulp off, a 4 x 700 batch); letting producers fuse into the reductions changes their rounding per fusion
  (seen: 40% of a 3-layer model's hidden values). The smaller CPU block keeps the tiny configs' short sequences
  cheap (16 of 128 keys would be padding); the contract asks for a fixed block, not for 128. Differentiable: the
  gradient is JAX autodiff of the vectorized math (on CPU through a custom VJP), the independent reference for the
  kernels' backward pass. It keeps each block's scores for the backward, so it is for tests, CPU runs and fallbacks,
  not for 4096-token training on a GPU.

  ``page_table_BxNb``: k/v are page pools (the paged form; forward only): on CPU each tile reads its sequences'
  pages, elsewhere the table's keys are gathered into a dense copy first.
  ``kv_codes``: k/v are E4M3 codes (FP16 operands, module docstring); implied by a float8_e4m3fn or float16 k.
  """
  block_kv = block_kv or key_block()
  check_operands(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, page_table_BxNb, block_kv)
  codes = is_codes(k_BxSxKxD, kv_codes)
  if page_table_BxNb is not None:
    return _reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, qk_scale, v_scale, block_kv,
                      tiled=jax.default_backend() == "cpu", table=page_table_BxNb.astype(jnp.int32), codes=codes)
  if jax.default_backend() != "cpu":
    return _reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, qk_scale, v_scale, block_kv, tiled=False,
                      codes=codes)
  return _reference_cpu(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT.astype(jnp.int32),
                        jnp.asarray(qk_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32), block_kv, codes)


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
