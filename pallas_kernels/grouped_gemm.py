"""Grouped (mixture-of-experts) block-scaled FP8 GEMM and its plain-jnp reference.

Rows are sorted by group: with ``off = exclusive_cumsum(group_sizes_E)`` (int32, traced; E static), rows
``[off_e, off_e + size_e)`` of A are multiplied by expert e's weight ``B_e``; rows at or beyond ``sum(group_sizes)``
give zeros. Sizes are clipped to the M rows there are (a group reaching past row M keeps only the rows before M).

Layout (also the Hopper kernel's, ``fp8_gemm_mgpu.grouped_fp8_gemm``): ``layout`` places each group's rows in a
buffer of the static size ``padded_rows(M, E) = round_up(M, 128) + min(E, M) * 128`` (at most min(E, M) groups are
non-empty, each padded by < 128 rows) where every group starts at a multiple of 128 rows (zero rows between groups),
and gives each 128-row tile its expert id (E for the unused tiles at the end). Each tile is then an ordinary dense
block GEMM against one expert, computed by ``fp8_gemm.fp8_gemm_reference`` itself (or ``invariant_dot`` for BF16
operands), so every row is bitwise the dense GEMM of its group's rows alone: rows are
independent in the dense math (batch invariance), and the 1x128-over-tokens groups of the wgrad operands start at
each group's first row, as in the dense wgrad of that group.

The wgrad GEMM (``grouped_wgrad_tiles``) contracts over tokens: dW_e accumulates, in increasing tile order, one
128-token K block per tile of group e, with the dense reference's per-block math, so dW_e is bitwise the dense
wgrad of group e's rows (an empty group gives exact zeros). BF16 mode's gradients (``grouped_dot_dgrad``,
``grouped_dot_wgrad``) are transposes of the dense ``invariant_dot``, likewise bitwise the dense autodiff per group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.core import BLOCK, invariant_dot, num_blocks
from pallas_kernels.fp8_gemm import fp8_gemm_reference


def padded_rows(m: int, num_groups: int) -> int:
  """Static row count of the tile buffer: enough for every non-empty group (at most min(E, M)) padded to a multiple
  of 128 (so decode-sized M does not pay for E tiles)."""
  return num_blocks(m) * BLOCK + min(num_groups, m) * BLOCK


def layout(group_sizes_E: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """-> (dest_M, tile_expert_T): each row's buffer row (``padded_rows`` = dropped, for rows past the groups) and
  each 128-row tile's expert (E for unused tiles). Negative sizes count as 0."""
  e = group_sizes_E.shape[0]
  p = padded_rows(m, e)
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_E.astype(jnp.int32), 0)), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  padded = (ends - starts + BLOCK - 1) // BLOCK * BLOCK
  pad_ends = jnp.cumsum(padded)
  pad_starts = pad_ends - padded
  rows = jnp.arange(m, dtype=jnp.int32)
  g = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # empty groups are skipped (equal ends)
  gc = jnp.minimum(g, e - 1)
  dest = jnp.where(g < e, pad_starts[gc] + rows - starts[gc], p)
  tile_expert = jnp.searchsorted(pad_ends, jnp.arange(0, p, BLOCK, dtype=jnp.int32), side="right")
  return dest.astype(jnp.int32), tile_expert.astype(jnp.int32)


def _gather_rows(x_MxK: jax.Array, idx_P: jax.Array) -> jax.Array:
  """Rows ``x[idx]`` (zeros where idx is out of range): a gather of whole rows."""
  return jnp.take(x_MxK, idx_P, axis=0, mode="fill", fill_value=0)


def source_rows(dest_M: jax.Array, p: int) -> jax.Array:
  """Each buffer row's source row (M where none): the inverse of ``dest_M``, by a scatter of the (M,) int32 map."""
  m = dest_M.shape[0]
  return jnp.full((p,), m, jnp.int32).at[dest_M].set(jnp.arange(m, dtype=jnp.int32), mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def to_tiles(x_MxK: jax.Array, dest_M: jax.Array, p: int) -> jax.Array:
  """Rows -> the (p, K) tile buffer (zeros between groups and after them).

  A gather of whole rows by each buffer row's source row, not a scatter of the rows: only the (M,) int32 index map
  is scattered (XLA's GPU scatter of whole rows was the slow part of the grouped op: docs/history.md, "Tried and
  dropped"). ``to_tiles`` and ``from_tiles`` are each other's transposes (every buffer row holds at most one row), so
  their gradients are the same two gathers, exact, with no scatter-add."""
  return _gather_rows(x_MxK, source_rows(dest_M, p))


def _to_tiles_fwd(x_MxK, dest_M, p):
  return to_tiles(x_MxK, dest_M, p), dest_M


def _to_tiles_bwd(p, dest_M, ct_PxK):
  return from_tiles(ct_PxK, dest_M), None


to_tiles.defvjp(_to_tiles_fwd, _to_tiles_bwd)


@jax.custom_vjp
def from_tiles(y_PxN: jax.Array, dest_M: jax.Array) -> jax.Array:
  """The tile buffer -> rows (zeros for the rows past the groups); buffer rows no row maps to are never read."""
  return _gather_rows(y_PxN, dest_M)


def _from_tiles_fwd(y_PxN, dest_M):
  return from_tiles(y_PxN, dest_M), (dest_M, y_PxN.shape[0])


def _from_tiles_bwd(res, ct_MxN):
  dest_M, p = res
  return to_tiles(ct_MxN, dest_M, p), None


from_tiles.defvjp(_from_tiles_fwd, _from_tiles_bwd)


def per_tile(tile_fn, a_PxK: jax.Array, a_s_PxKb: jax.Array | None, tile_expert_T: jax.Array, num_experts: int,
             n: int, out_dtype) -> jax.Array:
  """``tile_fn(a_128xK, a_s_128xKb, e) -> (128, n)`` for every used tile, in a fixed-shape loop (each tile runs the
  same dense code whatever M and the group sizes are); unused tiles (id E) give zeros without computing."""
  t = tile_expert_T.shape[0]
  a = a_PxK.reshape(t, BLOCK, -1)
  s = jnp.zeros((t, BLOCK, 0)) if a_s_PxKb is None else a_s_PxKb.reshape(t, BLOCK, -1)

  def body(xs):
    at, st, e = xs
    return jax.lax.cond(e < num_experts, lambda: tile_fn(at, st, e).astype(out_dtype),
                        lambda: jnp.zeros((BLOCK, n), out_dtype))

  return jax.lax.map(body, (a, s, tile_expert_T)).reshape(t * BLOCK, n)


def tile_operands(a_q_MxK, a_s_MxKb, group_sizes_E, num_groups: int):
  """Quantized rows (E4M3 (M, K), scales (M, Kb)) -> (a_q_PxK, a_s_PxKb, dest_M, tile_expert_T): the tile buffers
  of ``layout`` (zero rows and zero scales between and after the groups), for the reference and the kernel alike."""
  m = a_q_MxK.shape[0]
  dest, tile_expert = layout(group_sizes_E, m)
  p = padded_rows(m, num_groups)
  # FP8 rows move as their bytes (a gather of the storage bits; no arithmetic on E4M3 values).
  a_bits = to_tiles(jax.lax.bitcast_convert_type(a_q_MxK, jnp.uint8), dest, p)
  a_q = jax.lax.bitcast_convert_type(a_bits, a_q_MxK.dtype)
  return a_q, to_tiles(a_s_MxKb, dest, p), dest, tile_expert


def gemm_tiles_reference(a_q_PxK, a_s_PxKb, b_q_ExNxK, b_s, tile_expert_T, out_dtype=jnp.bfloat16):
  """Grouped ``C = A . B_e^T`` on the tile buffer: each used tile is ``fp8_gemm_reference`` against its expert;
  unused tiles give zeros. (P, N) ``out_dtype``."""
  e, n = b_q_ExNxK.shape[0], b_q_ExNxK.shape[1]
  tile = lambda at, st, ei: fp8_gemm_reference(at, st, b_q_ExNxK[ei], b_s[ei], out_dtype=out_dtype)
  return per_tile(tile, a_q_PxK, a_s_PxKb, tile_expert_T, e, n, out_dtype)


def grouped_gemm_reference(a_q_MxK, a_s_MxKb, b_q_ExNxK, b_s, group_sizes_E, out_dtype=jnp.bfloat16):
  """Grouped ``C = A . B_e^T`` on quantized operands (layouts of ``fp8_gemm``, B stacked over experts: b_q (E, N, K),
  b_s (E, Nb, Kb) or (E, N, Kb)). A's 1x128 groups run along K, so its rows move to the tile buffer unchanged."""
  a_q, a_s, dest, tile_expert = tile_operands(a_q_MxK, a_s_MxKb, group_sizes_E, b_q_ExNxK.shape[0])
  return from_tiles(gemm_tiles_reference(a_q, a_s, b_q_ExNxK, b_s, tile_expert, out_dtype), dest)


def dot_tiles_reference(x_PxK, w_ExNxK, tile_expert_T) -> jax.Array:
  """BF16-mode grouped ``x . w_e^T`` on the tile buffer: the dense ``invariant_dot`` (FP32 accumulation) per tile;
  FP32 out."""
  e, n = w_ExNxK.shape[0], w_ExNxK.shape[1]
  return per_tile(lambda at, _, ei: invariant_dot(at, w_ExNxK[ei]), x_PxK, None, tile_expert_T, e, n, jnp.float32)


POSITION_COST = 5  # a tile product in a batched step of all experts costs ~1/5 of one in a per-tile step (H200)


def sum_by_tile(tile_fn, tile_expert_T: jax.Array, num_experts: int, shape) -> jax.Array:
  """acc_e = the sum over group e's tiles, in tile order, of ``tile_fn(t)`` (the (*shape) FP32 product of tile t) ->
  (E, *shape) FP32; an empty group gives zeros. Two loops give the same sums (each expert's tiles added in tile
  order) at different costs, picked per call from the group sizes:
  * by tile position: step j adds every group's j-th tile at once (``tile_fn`` vmapped over experts), as many steps
    as the largest group has tiles, each computing E products: cheap when groups are about equal;
  * per tile: one step per used tile: the cheaper one when a few groups hold most tiles (E x the largest group's
    tiles would exceed ``POSITION_COST`` x the used tiles)."""
  t = tile_expert_T.shape[0]
  counts = jnp.bincount(tile_expert_T, length=num_experts + 1)[:num_experts]  # unused tiles are id E
  first = jnp.searchsorted(tile_expert_T, jnp.arange(num_experts, dtype=tile_expert_T.dtype), side="left")
  zeros = jnp.zeros((num_experts, *shape), jnp.float32)
  batched = jax.vmap(tile_fn)

  def by_position():
    def step(j, acc):
      prod = batched(jnp.minimum(first + j, t - 1))
      return jnp.where((j < counts).reshape(-1, *([1] * len(shape))), acc + prod, acc)
    return jax.lax.fori_loop(0, jnp.max(counts), step, zeros)

  def per_tile():
    def step(ti, acc):
      e = tile_expert_T[ti]
      return jax.lax.cond(e < num_experts, lambda: acc.at[e].add(tile_fn(ti)), lambda: acc)
    return jax.lax.fori_loop(0, t, step, zeros)

  used = jnp.sum(counts)
  return jax.lax.cond(num_experts * jnp.max(counts) <= POSITION_COST * used, by_position, per_tile)


def grouped_wgrad_tiles(a_q_NxP, a_s_NxT, b_q_KxP, b_s_KxT, tile_expert_T, num_experts: int) -> jax.Array:
  """dW_e = sum over group e's token tiles of A_tile . B_tile^T -> (E, N, K) FP32.

  Operands are the tile buffers quantized 1x128 over tokens (``quant.quantize_act_t`` of the (P, .) buffers), so
  tile t is K block t of the dense wgrad GEMM. Group e's tiles add ``fp8_gemm_reference`` of their one K block to
  its accumulator, in increasing tile order: the dense reference's per-block math in the dense order
  (``sum_by_tile``)."""
  n, k, t = a_q_NxP.shape[0], b_q_KxP.shape[0], tile_expert_T.shape[0]
  a = a_q_NxP.reshape(n, t, BLOCK).transpose(1, 0, 2)
  b = b_q_KxP.reshape(k, t, BLOCK).transpose(1, 0, 2)
  sa, sb = a_s_NxT.T, b_s_KxT.T
  tile = lambda i: fp8_gemm_reference(a[i], sa[i][:, None], b[i], sb[i][:, None], out_dtype=jnp.float32)
  return sum_by_tile(tile, tile_expert_T, num_experts, (n, k))


def dot_tiles_wgrad_by_tile(ct_PxN, x_PxK, tile_expert_T, num_experts: int) -> jax.Array:
  """dW_e = the sum over group e's tiles, in tile order, of ``ct_tile^T . x_tile`` (each a 128-token FP32 dot) ->
  (E, N, K) FP32: ``grouped_wgrad_tiles``' loop in BF16 mode. One dense wgrad of the buffer in all (``dot_tiles_wgrad``
  costs E; ``sum_by_tile``); not bitwise the dense autodiff dw (that sums all of a group's tokens in one dot), equal
  within FP32 rounding (tests/test_grouped.py)."""
  n, k, t = ct_PxN.shape[1], x_PxK.shape[1], tile_expert_T.shape[0]
  c, x = ct_PxN.reshape(t, BLOCK, n), x_PxK.reshape(t, BLOCK, k)
  prod = lambda i: jnp.dot(c[i].T, x[i].astype(c.dtype), precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return sum_by_tile(prod, tile_expert_T, num_experts, (n, k))


def dot_tiles_dgrad(ct_PxN, w_ExNxK, tile_expert_T) -> jax.Array:
  """The VJP of ``dot_tiles_reference`` for x: per tile, the transpose of the dense ``invariant_dot`` (so each
  group's rows are bitwise the dense autodiff dx). ``ct_PxN`` is the FP32 cotangent; dx (P, K) in w's dtype."""
  e, _, k = w_ExNxK.shape
  a_struct = jax.ShapeDtypeStruct((BLOCK, k), w_ExNxK.dtype)
  tile = lambda ct, _, ei: jax.linear_transpose(lambda a: invariant_dot(a, w_ExNxK[ei]), a_struct)(ct)[0]
  return per_tile(tile, ct_PxN, None, tile_expert_T, e, k, w_ExNxK.dtype)


def dot_tiles_wgrad(ct_PxN, x_PxK, tile_expert_T, num_experts: int) -> jax.Array:
  """The VJP of ``dot_tiles_reference`` for w -> (E, N, K) in x's dtype: for each expert, the transpose of the
  dense ``invariant_dot`` over the whole tile buffer with the other groups' rows zeroed. A zero row adds exact
  zeros, so this is the dense autodiff dw of the group's rows alone (checked bitwise on XLA:CPU); it costs E dense
  wgrads of the buffer (a reference, not a kernel)."""
  n, k = ct_PxN.shape[1], x_PxK.shape[1]
  b_struct = jax.ShapeDtypeStruct((n, k), x_PxK.dtype)

  def expert(ei):
    rows = jnp.repeat(tile_expert_T == ei, BLOCK)[:, None]
    xe, ce = jnp.where(rows, x_PxK, 0).astype(x_PxK.dtype), jnp.where(rows, ct_PxN, 0).astype(ct_PxN.dtype)
    return jax.linear_transpose(lambda b: invariant_dot(xe, b), b_struct)(ce)[0]

  return jax.lax.map(expert, jnp.arange(num_experts, dtype=jnp.int32))


def routing_sizes(tokens: int, top_k: int, e: int, skew: float, seed: int = 0) -> np.ndarray:
  """Synthetic group sizes of ``tokens * top_k`` routed rows (tests, benchmarks): balanced (skew 0) or Zipf-like
  (expert i's weight (i + 1) ** -skew), with E/16 empty experts when skewed."""
  rows = tokens * top_k
  if skew == 0:
    sizes = np.full(e, rows // e)
    sizes[: rows - sizes.sum()] += 1
    return sizes.astype(np.int32)
  w = (np.arange(e) + 1.0) ** -skew
  w[np.random.default_rng(seed).permutation(e)[: e // 16]] = 0  # some experts get no tokens
  sizes = np.floor(w / w.sum() * rows).astype(np.int64)
  sizes[np.argmax(w)] += rows - sizes.sum()
  return sizes.astype(np.int32)
