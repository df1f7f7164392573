"""Flash attention for training, prefill and decode in Pallas (Triton backend): one tile body for every caller.

Math and operands: ``pallas_kernels.attention`` (the contract and its plain-jnp reference). Every query row goes
through ``_attend_tile`` (or its pieces: ``_update`` per key block, ``_finish``): a (block_q x D) tile of query rows
with their positions, looping over 128-key blocks of one key/value head in increasing order with the online-softmax
update of the contract. Two entry points feed it:
* ``attention_seq``: rows are consecutive positions of one query head (training forward, prefill); grid
  (B, H, T / block_q); the forward also writes the row's log-sum-exp for the backward pass;
* ``attention_heads``: rows are the G query heads of one key/value head at one position (decode: one new token per
  slot over the slot's cache), zero-padded to block_q rows in registers (read from and stored to the (B, H, D)
  layout directly, the padding rows masked); grid (B, K, ceil(G / block_q)).
Both compile the same body, and a row's result does not depend on the tile it sits in: the tensor-core dots give
each element the same bits in every tile shape (wgmma tiles of 64 / 128 rows, mma.sync tiles of 16: measured by
``scripts/check_tile_bits.py`` for 16-bit operands in their natural k order, which is why the FP8 cache is held in
pair order, ``_load_block``), the row max is exact, and the row sum is exact integer arithmetic in fixed point
(``_row_sum``). So a decode row in a 16-row tile and the training row at the same position in a 128-row tile are
bitwise equal (tested on the H200 at every position of four sequences, tests/test_attention.py). A tile visits key
blocks up to its last row's position only, so decode reads the filled part of each slot's cache (length aware),
and causal training skips the blocks above the diagonal; no S x S (or T x T) tensor exists anywhere.

Keys come as BF16 values or as E4M3 codes: float8_e4m3fn (the FP8 KV cache), converted exactly to FP16 in
registers (one conversion per pair), or the same codes already held in float16 (the training forward: the trainer's
``fp8jax.kvcache.kv_codes`` cast by ``fp8jax.attention``), so both see identical operands. Codes take the contract's
FP16 operands (Q clipped and rounded to FP16, P rounded to FP16); the FP8 cache's scales are the two FP32 scalars
``qk_scale`` (into the scores) and ``v_scale`` (into the output).

Two evaluation details (compiled kernels; interpret mode keeps jnp.exp2): the exponentials are the MUFU.EX2
instruction alone (``ex2.approx.ftz.f32``, without libdevice's path for results below 2**-126, which cannot change an
output), and the score scale is folded into the exponent, P = 2**fma(raw dot, qk_scale, -m0) with the row max taken
over the raw dots and scaled once (the contract's value, as rounding is monotone; one rounding fewer in the
exponent's argument). Every caller runs the same code, so decode rows stay bitwise the training rows.

Backward (``attention_seq_bwd``, FlashAttention-2's recomputation, Dao 2023 sec. 3.2): the row statistic
lse = m + log2(l) from the forward gives P = 2**fma(raw dot, qk_scale, -lse) per block again; delta =
rowsum(dO * O) (an XLA reduction); one kernel per key block accumulates dK, dV over the query tiles and the G heads
that see it (no atomics, no per-head dK copies), another per query tile accumulates dQ over its key blocks.

Why the Triton backend of Pallas: one kernel body must serve three callers bit for bit, run in interpret mode on CPU
(so CI checks this exact body against the reference) and read FP8 or BF16 keys; Triton lowers the dynamic,
data-dependent loop bounds (per-slot lengths) and masked tiles directly. The Hopper-specific Mosaic GPU version
(warp-specialized, TMA, wgmma pipelining as in FlashAttention-3) is the next step for speed; docs/performance.md has the
measured figures of this one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention import BLOCK_KV, FP16_MAX, check_operands, pad_keys

HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Tile and launch settings of the forward (training / prefill: block_q, num_warps, num_stages; decode: decode_*)
  and of the backward.

  Bits: no setting here changes a row's result (module docstring: tile-independent dots, exact row max, fixed-point
  row sum), except that E4M3 codes in natural order need a wgmma tile (``decode_block_q_natural_fp8``: an 8-bit
  operand in a 16-row mma.sync tile is permuted in k, ``_load_block``). Tested on the GPU for the defaults
  (tests/test_attention.py) and per config by ``bench_attention.py --sweep``. block_q divides BLOCK_KV, so the rows
  of a training tile all end in the same key block. The stages only pipeline loads (speed, not bits); the
  backward's blocks are free (it recomputes P from the forward's row lse). ``prefix_block_q``: the shared-prefix
  pass's rows (prefix_block_q / G sequences per tile; None: ``prefix_rows``).
  """

  block_q: int = 128
  num_warps: int = 8
  num_stages: int = 3
  decode_block_q: int = 16
  decode_block_q_natural_fp8: int = 64
  prefix_block_q: int | None = None  # None: PREFIX_SEQS sequences' rows (``prefix_rows``)
  prefix_num_warps: int = 4
  decode_num_warps: int = 4
  decode_num_stages: int = 3  # FP8 K/V (2 before the carriers' one-instruction conversion; 3 is faster since)
  decode_num_stages_bf16: int = 3
  decode_num_stages_natural_fp8: int = 2  # the 64-row tile over natural-order codes (3: 365 vs 280 us per layer)
  prefix_num_stages: int = 2  # the shared-prefix pass (its 64-row tile: 3 stages leave one program per SM)
  bwd_block_q: int = 64
  bwd_block_kv: int = 64
  bwd_num_warps: int = 4
  bwd_num_stages: int = 2

  def __post_init__(self):
    for name in ("bwd_block_q", "bwd_block_kv"):
      if getattr(self, name) not in (16, 32, 64, 128):
        raise ValueError(f"TuningConfig.{name} must be 16, 32, 64 or 128 (divide {BLOCK_KV}), got {self}")
    for name in ("block_q", "decode_block_q", "decode_block_q_natural_fp8", "prefix_block_q"):
      value = getattr(self, name)
      if value not in (16, 32, 64, 128) and (value is not None or name != "prefix_block_q"):  # prefix: None = auto
        raise ValueError(f"TuningConfig.{name} must be 16, 32, 64 or 128 (divide {BLOCK_KV}), got {self}")
    for name in ("num_warps", "decode_num_warps", "prefix_num_warps", "bwd_num_warps"):
      if getattr(self, name) not in (1, 2, 4, 8):
        raise ValueError(f"TuningConfig.{name} must be 1, 2, 4 or 8, got {getattr(self, name)}")


# Sequences per shared-prefix tile by default: 4 (16 rows at G = 4) ran 2-7% faster than 16 (64 rows) at rollout
# shapes on the H200 (bench_attention.py --rollout_decode, fifteenth session); fewer rows per sequence read a
# prompt's pages once for more of its samples, more give the pass fewer, longer programs.
PREFIX_SEQS = 4


def prefix_rows(config: TuningConfig, g: int, natural_fp8: bool = False) -> int:
  """Rows of a shared-prefix tile for G query heads per KV head: ``config.prefix_block_q``, or PREFIX_SEQS
  sequences' rows (a power of two from 16, the smallest dot tile, to 128). Over E4M3 codes in natural order
  (``natural_fp8``) at least ``decode_block_q_natural_fp8`` rows, as the decode tile: a 16-row tile permutes the
  8-bit operand in k and gives other bits (seen on the H200: the every-position test, 16 rows at G = 4)."""
  rows = config.prefix_block_q or min(128, max(16, 1 << (PREFIX_SEQS * g - 1).bit_length()))
  return max(rows, config.decode_block_q_natural_fp8) if natural_fp8 else rows


def unsupported(q, k) -> str | None:
  """Why the kernels cannot take these operands (None if they can): the caller logs it and uses the reference."""
  d = q.shape[-1]
  if d not in HEAD_DIMS:
    return f"head_dim {d} (kernels take {HEAD_DIMS})"
  if jnp.dtype(q.dtype) != jnp.dtype(jnp.bfloat16):
    return f"q dtype {q.dtype} (kernels take bfloat16)"
  if jnp.dtype(k.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float16)):
    return f"k/v dtype {k.dtype} (kernels take bfloat16, or codes as float8_e4m3fn or float16)"
  return None


# ------------------------------------------------------------------------------------------------------------------
# The tile body (shared by decode, prefill and the training forward)
# ------------------------------------------------------------------------------------------------------------------


# 2**x as the kernels compute it: the MUFU.EX2 instruction alone (``ex2.approx.ftz.f32``). Pallas lowers jnp.exp2 to
# libdevice's exp2f, the same instruction wrapped in a path for results below 2**-126 (a compare and two multiplies
# per element: 18% of the FP8 decode tile's instructions, Nsight Compute 2026-12-04). Such results flush to zero here;
# they cannot change an output (P rounds to FP16, whose smallest value is 2**-24, and l >= 1 absorbs them), and
# decode and training run this same code, so their rows stay bitwise equal.
_EX2 = "ex2.approx.ftz.f32 $0, $1;"
# 2**(s * c - t) with the product and the difference rounded once (fma.rn), as one instruction before the EX2.
_FMA_EX2 = "{ .reg .f32 t; fma.rn.f32 t, $1, $2, $3; ex2.approx.ftz.f32 $0, t; }"


def _asm(asm: str, *args):
  f32 = jnp.float32
  shape = jnp.broadcast_shapes(*(a.shape for a in args))
  [y] = pltriton.elementwise_inline_asm(asm, args=[jnp.broadcast_to(a.astype(f32), shape) for a in args],
                                        constraints="=f," + ",".join("f" * len(args)), pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, f32)])
  return y


def _exp2(x, compiled: bool):
  """2**x: the instruction above when ``compiled``; jnp.exp2 in interpret mode (CPU)."""
  return _asm(_EX2, x) if compiled else jnp.exp2(x)


def _exp2_scaled(s, c, t, compiled: bool):
  """2**(s * c - t): one FMA then the EX2 when ``compiled``; interpret mode: the same formula in jnp."""
  return _asm(_FMA_EX2, s, c, -t) if compiled else jnp.exp2(s * c - t)


def _update(carry, q, kb, vb, start, key, pos, last, qk_scale, *, masked: bool, compiled: bool):
  """One key block of the contract's online softmax for a tile of rows (exact whether or not ``masked``, when
  every key of the block is visible to every row: the masks then select nothing).

  The scores' scale enters where the contract puts it, folded into the exponent's FMA: the row max is taken over
  the raw dots and scaled once (the same value: rounding is monotone and qk_scale > 0), and P = 2**(raw * qk_scale
  - m0) rounds the exponent's argument once instead of twice."""
  m, l, acc = carry
  if masked:  # keys past the tile's last row (stale cache rows, padding) enter only as zeros
    vb = tuple(jnp.where((key <= last)[:, None], x, jnp.zeros((), x.dtype)) for x in vb)
  s = functools.reduce(jnp.add, (_dot_t(a, b) for a, b in zip(q, kb)))  # over the head-dim parts (_load_block)
  if masked:
    s = jnp.where(key[None, :] <= pos[:, None], s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=1) * qk_scale)
  m0 = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = _exp2(m - m0, compiled)
  p = _exp2_scaled(s, qk_scale, m0[:, None], compiled)
  p_op = p.astype(vb[0].dtype)
  l_new = l * alpha + _row_sum(p)
  acc_new = tuple(a * alpha[:, None] + _dot(p_op, v) for a, v in zip(acc, vb))
  if not masked:
    return m_new, l_new, acc_new
  active = start <= pos  # a row's state changes only in the blocks up to its own position
  return (jnp.where(active, m_new, m), jnp.where(active, l_new, l),
          tuple(jnp.where(active[:, None], a_new, a) for a_new, a in zip(acc_new, acc)))


def _dot_t(a, b):
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# The row sum in fixed point: p in [0, 1] plus 3.0 lands in [3, 4], where FP32's spacing is 2**-22, so the bits of
# p + 3.0 minus those of 3.0 are round(p * 2**22) (exactly; p = 1 gives 4.0 = 3.0's bits + 2**22).
_FIX_ORIGIN, _FIX_ORIGIN_BITS, _FIX_UNIT = 3.0, 0x40400000, 2.0**-22


def _row_sum(p):
  """sum_j p[:, j] for FP32 p in [0, 1] (rows, n): each term rounded to a multiple of 2**-22, the terms added as
  integers, the sum converted back to FP32. (The block's max term is 1 up to the exponent FMA's rounding, ~|m0|
  2**-24 in log2 units; a term that lands above 1 counts its excess at half weight: an error of that order.)

  Why not jnp.sum: a float reduction adds a row's values in an order set by the tile's layout (a wgmma tile keeps
  a row's keys in one warp; a 16-row mma.sync tile splits them over four warps and adds the warps' partial sums),
  so the same row would round differently in a decode tile and a training tile. Integer addition is exact, so
  every order gives the same bits: the row sum is layout-free by construction. (A dot with a ones block, also
  layout-free on the tensor cores, cost the 128-row training tile 30% of its speed: docs/history.md.) The
  integers are the bits of p + 3.0 summed with two's-complement wrap-around, minus n times 3.0's bits: exact, as the
  true sum (<= n * 2**22 < 2**31 for n <= 256) fits. Accuracy: each term is within 2**-23 of p, so the block's sum is
  within n * 2**-23 (rms ~sqrt(n / 12) * 2**-22: 8e-7 at 128) of the exact one, against a row's l >= 1 (its max's
  term is 1): the FP32 sum's accuracy."""
  n = p.shape[1]
  bits = lax.bitcast_convert_type(p + jnp.float32(_FIX_ORIGIN), jnp.int32)
  offset = (n * _FIX_ORIGIN_BITS + 2**31) % 2**32 - 2**31  # n * bits(3.0) in int32's wrap-around
  return (jnp.sum(bits, axis=1) - jnp.int32(offset)).astype(jnp.float32) * jnp.float32(_FIX_UNIT)


def _fp16(x):
  """The contract's FP16 operand for E4M3 codes: clipped to FP16's range, rounded (codes and P: exact / in range)."""
  return jnp.clip(x.astype(jnp.float32), -FP16_MAX, FP16_MAX).astype(jnp.float16)


_CODE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float16), jnp.dtype(jnp.uint16))


def _is_codes(kv_ref_dtype) -> bool:
  """K/V refs of E4M3 codes: float8_e4m3fn, float16, or uint16 carriers of pair-ordered codes."""
  return jnp.dtype(kv_ref_dtype) in _CODE_DTYPES


def _parts(d: int, kv_ref_dtype) -> tuple[tuple[int, int], ...]:
  """The head-dim parts (offset, width) the dots run over: the two halves for E4M3 codes (``_load_block`` says
  why), the whole head dim for BF16 values. One choice per K/V form, the same in every tile."""
  n = 2 if _is_codes(kv_ref_dtype) else 1
  return tuple((i * d // n, d // n) for i in range(n))


def _operands(q, kv_dtype):
  """(q as the dots take it, K/V block dtype): FP16 operands for E4M3 codes, else q's. ``q``: a tuple of the
  head-dim parts (``_parts``)."""
  if _is_codes(kv_dtype):
    return jax.tree.map(_fp16, q), jnp.float16
  return q, jax.tree.leaves(q)[0].dtype


# One carrier's E4M3 pair -> FP16 x2 in one instruction (the low byte, head dim i, to the low 16 bits).
_CVT_CARRIER = "cvt.rn.f16x2.e4m3x2 $0, $1;"


def _unpack_carriers(c, compiled: bool):
  """uint16 carriers (n, D/2) of a pair-ordered FP8 row (byte 2i = code i, byte 2i + 1 = code i + D/2) -> the two
  head-dim halves as FP16 (exact). Each half comes from its own 16-bit lanes, so the dots see FP16 operands loaded
  16 bits at a time (kWidth 2, the layout of every other form); see ``_load_block``. Compiled: one conversion per
  carrier (the PTX above) and the two halves taken from its result's 16-bit halves (the per-byte masks, shifts and
  conversions Triton makes of the jnp form cost more instructions); interpret mode: the same values in jnp."""
  if compiled:
    [x] = pltriton.elementwise_inline_asm(  # signless integers for Triton's asm op
        _CVT_CARRIER, args=[lax.bitcast_convert_type(c, jnp.int16)], constraints="=r,h", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.int32)])
    half = lambda u: lax.bitcast_convert_type(u.astype(jnp.int16), jnp.float16)  # noqa: E731
    return half(x), half(lax.shift_right_logical(x, jnp.int32(16)))
  f = lambda u: lax.bitcast_convert_type(u, jnp.float8_e4m3fn).astype(jnp.float16)  # noqa: E731
  return f((c & 0xFF).astype(jnp.uint8)), f(lax.shift_right_logical(c, jnp.uint16(8)).astype(jnp.uint8))


def _load_block(k_ref, v_ref, b, pages, j, kvh, kv_dtype, compiled: bool):
  """Key block j of key/value head ``kvh``: (first key index, K parts, V parts) as the dots take them, each a tuple
  of the head-dim parts (``_parts``: the halves for codes, the whole head dim for BF16). Dense refs read sequence
  ``b``; with ``pages`` (the sequence's page-table row, loaded before the loop: no load the K/V addresses wait on)
  the refs are page pools and the block is page ``pages[j]``.

  Why halves: where the dots run as mma.sync (the decode tile's 16 rows), Triton lays out an operand converted from
  an 8-bit load with four consecutive k values per thread (kWidth 4), which permutes k inside each 16-wide MMA step,
  and the tensor core's sum inside a step depends on that order: decode rows over E4M3 codes then differ from the
  training rows (measured, docs/history.md). The FP8 cache therefore holds its codes pair-ordered and is read as
  uint16 carriers (``_unpack_carriers``), which gives each half 16-bit lanes; the other code forms read their halves
  as they are. The dots over halves are the codes' dots in every tile (training, prefill, decode). BF16 K/V need no
  split (kWidth 2 already): one dot over the whole head dim, which keeps the 128-row training tile's registers."""
  start = pl.multiple_of(j * BLOCK_KV, BLOCK_KV)
  idx = (b, pl.ds(start, BLOCK_KV)) if pages is None else (
      jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, pages.shape, 0) == j, pages, 0)), slice(None))
  if k_ref.dtype == jnp.uint16:
    return start, *(_unpack_carriers(r[(*idx, kvh, slice(None))], compiled) for r in (k_ref, v_ref))
  parts = lambda r: tuple(  # noqa: E731
      r[(*idx, kvh, pl.ds(o, w))].astype(kv_dtype) for o, w in _parts(k_ref.shape[-1], k_ref.dtype))
  return start, parts(k_ref), parts(v_ref)


def _blocks(carry, q, k_ref, v_ref, b, pages, kvh, qk_scale, kv_dtype, lo, hi, pos=None, last=None, *,
            compiled: bool):
  """Key blocks lo .. hi - 1 in order through ``_update``: unmasked (every key visible to every row), or masked by
  the rows' positions ``pos`` (the tile's last row at ``last``)."""
  def block(j, carry):
    start, kb, vb = _load_block(k_ref, v_ref, b, pages, j, kvh, kv_dtype, compiled)
    key = start + lax.broadcasted_iota(jnp.int32, (BLOCK_KV,), 0)
    return _update(carry, q, kb, vb, start, key, pos, last, qk_scale, masked=pos is not None, compiled=compiled)

  return lax.fori_loop(lo, hi, block, carry)


def _empty_state(bq, parts):
  """The online softmax's state before any key: (m, l, acc) = (-inf, 0, 0), acc as its head-dim ``parts``."""
  return (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
          tuple(jnp.zeros((bq, w), jnp.float32) for _, w in parts))


def _attend_tile(q, pos, k_ref, v_ref, b, kvh, qk_scale, v_scale, n_kb: int, pt_ref=None, resume=None, *,
                 compiled: bool):
  """Query rows at positions ``pos`` (``q``: their head-dim parts, ``_parts``) over key/value head ``kvh`` of
  sequence ``b`` -> (out parts in q's dtype, lse (block_q,) FP32 log2 units; +inf for a row that sees no key).

  ``pt_ref``: the paged form, k/v refs are page pools (N, BLOCK_KV, K, D) and key block j of sequence b is page
  ``pt_ref[b, j]`` (the same blocks in the same order: the same bits as the dense form).
  ``resume``: (j0, (m, l, acc)): the rows' state after their key blocks 0 .. j0 - 1, which a shared-prefix tile
  computed (``attention_heads(shared_blocks_B=)``); the tile goes on from block j0 (every row sees blocks < j0 in
  full). The state crosses HBM in FP32, exactly, so the rows end with the bits of one pass from block 0."""
  bq = q[0].shape[0]
  out_dtype = q[0].dtype
  parts = tuple(zip(itertools.accumulate((x.shape[1] for x in q), initial=0), (x.shape[1] for x in q)))
  q, kv_dtype = _operands(q, k_ref.dtype)
  last = jnp.max(pos)
  big = jnp.int32(2**30)
  first = jnp.min(jnp.where(pos >= 0, pos, big))
  n_blocks = jnp.minimum(lax.div(last + BLOCK_KV, BLOCK_KV), n_kb)  # blocks 0 .. last // BLOCK_KV
  # Blocks every real row sees in full take the unmasked update (same bits); padding rows (pos -1) get garbage
  # there that nothing reads (out is sliced off, the backward masks P by position).
  n_full = jnp.minimum(lax.div(jnp.minimum(first, last) + 1, BLOCK_KV), n_blocks)
  pages = None if pt_ref is None else pt_ref[b, :]  # this sequence's page table row (padded to a power of two)
  j0, carry = (0, _empty_state(bq, parts)) if resume is None else resume
  if resume is not None:
    n_full = jnp.maximum(n_full, j0)
  carry = _blocks(carry, q, k_ref, v_ref, b, pages, kvh, qk_scale, kv_dtype, j0, n_full, compiled=compiled)
  state = _blocks(carry, q, k_ref, v_ref, b, pages, kvh, qk_scale, kv_dtype, n_full, n_blocks, pos, last,
                  compiled=compiled)
  return _finish(state, v_scale, out_dtype)


def _finish(state, v_scale, out_dtype):
  """The online softmax's state (m, l, acc) after a row's last key block -> (out parts in ``out_dtype``, lse FP32
  log2 units; zeros and +inf for a row that saw no key)."""
  m, l, acc = state
  seen = l > 0
  inv = jnp.where(seen, v_scale / jnp.where(seen, l, 1.0), 0.0)
  out = tuple((a * inv[:, None]).astype(out_dtype) for a in acc)
  lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
  return out, lse


def _seq_fwd_kernel(q_ref, k_ref, v_ref, pos_ref, sc_ref, *rest, g: int, n_kb: int, bq: int, paged: bool,
                    compiled: bool):
  pt_ref, (o_ref, lse_ref) = (rest[0], rest[1:]) if paged else (None, rest)
  b, h, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = pl.ds(pl.multiple_of(ti * bq, bq), bq)
  parts = _parts(q_ref.shape[-1], k_ref.dtype)
  q = tuple(q_ref[b, rows, h, pl.ds(o, w)] for o, w in parts)
  out, lse = _attend_tile(q, pos_ref[b, rows], k_ref, v_ref, b, lax.div(h, g), sc_ref[0], sc_ref[1], n_kb, pt_ref,
                          compiled=compiled)
  for (o, w), x in zip(parts, out):
    o_ref[b, rows, h, pl.ds(o, w)] = x
  lse_ref[b, h, rows] = lse


def _store_rows(ref, prefix: tuple, rows, real, parts, values):
  """ref[*prefix, rows[i], :] = the row i of the head-dim ``parts``' ``values``, for the real rows only (padding
  rows' indices point past the last row: distinct, never written; masked off on the GPU, dropped by interpret mode's
  scatter)."""
  for (o, w), x in zip(parts, values):
    cols = o + lax.broadcasted_iota(jnp.int32, (1, w), 1)
    pltriton.store(ref.at[(*prefix, rows[:, None], cols)], x, mask=jnp.broadcast_to(real[:, None], x.shape))


def _query_parts(q_ref, idx, real, parts):
  """The head-dim parts of the query rows q_ref[*idx, :], zeros for the padding rows (built in registers)."""
  return tuple(jnp.where(real[:, None], q_ref[(*idx, pl.ds(o, w))], jnp.zeros((), q_ref.dtype)) for o, w in parts)


def _heads_fwd_kernel(q_ref, k_ref, v_ref, pos_ref, sc_ref, *rest, g: int, n_kb: int, bq: int, paged: bool,
                      shared: bool, compiled: bool):
  pt_ref, rest = (rest[0], rest[1:]) if paged else (None, rest)
  (nb_ref, m_ref, l_ref, acc_ref, o_ref) = rest if shared else (None,) * 4 + rest
  b, kvh, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  # Rows ti * bq + r of the G heads of KV head kvh, read straight from the (B, H, D) queries: rows past G (the
  # padding up to the tile's block_q rows) are built in registers as zeros at position -1, never in HBM.
  r = ti * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
  real = r < g
  heads = kvh * g + jnp.minimum(r, g - 1)  # padding rows load a real row (in bounds), then are zeroed
  parts = _parts(q_ref.shape[-1], k_ref.dtype)
  q = _query_parts(q_ref, (b, heads), real, parts)
  pos = jnp.where(real, pos_ref[b], -1)
  resume = None
  if shared:  # the state after the shared prefix blocks, from the prefix pass (none: start from block 0)
    j0 = nb_ref[b]
    row = b * q_ref.shape[1] + heads
    state = (m_ref[row], l_ref[row], tuple(acc_ref[row, pl.ds(o, w)] for o, w in parts))
    resume = (j0, jax.tree.map(lambda x, e: jnp.where(j0 > 0, x, e), state, _empty_state(bq, parts)))
  out, _ = _attend_tile(q, pos, k_ref, v_ref, b, kvh, sc_ref[0], sc_ref[1], n_kb, pt_ref, resume, compiled=compiled)
  _store_rows(o_ref, (b,), jnp.where(real, heads, o_ref.shape[1] + r), real, parts, out)


def _prefix_tile(q_ref, k_ref, tiles_ref, t, kvh, g: int, bq: int, per_tile: int):
  """The rows of shared-prefix tile t for KV head ``kvh``: row r is head r % G of the tile's sequence r // G ->
  (r, sequence (clipped in range), head, real (a row of a listed sequence), the head-dim parts, the rows' query
  operands (zeros for padding rows), the K/V block dtype)."""
  r = lax.broadcasted_iota(jnp.int32, (bq,), 0)
  row_slot = jnp.minimum(r // g, per_tile - 1)
  seq = tiles_ref[t, row_slot]
  real = (r < per_tile * g) & (seq >= 0)
  seq_c = jnp.clip(seq, 0, q_ref.shape[0] - 1)
  heads = kvh * g + r % g
  parts = _parts(q_ref.shape[-1], k_ref.dtype)
  q, kv_dtype = _operands(_query_parts(q_ref, (seq_c, heads), real, parts), k_ref.dtype)
  return r, seq_c, heads, real, parts, q, kv_dtype


def _prefix_kernel(q_ref, k_ref, v_ref, tiles_ref, nb_ref, sc_ref, pt_ref, m_ref, l_ref, acc_ref, *, g: int,
                   bq: int, per_tile: int, compiled: bool):
  """One shared-prefix tile: the G heads of KV head ``kvh`` for up to ``per_tile`` sequences (``tiles_ref[t]``)
  whose first ``nb`` key blocks are the same pages, over those blocks (unmasked: every row sees them in full) ->
  each row's online-softmax state, FP32, at row b * H + h of m / l / acc."""
  t, kvh = pl.program_id(0), pl.program_id(1)
  n_seq, n_heads = q_ref.shape[0], q_ref.shape[1]
  lead = tiles_ref[t, 0]

  @pl.when(lead >= 0)
  def _():
    r, seq_c, heads, real, parts, q, kv_dtype = _prefix_tile(q_ref, k_ref, tiles_ref, t, kvh, g, bq, per_tile)
    first = jnp.minimum(lead, n_seq - 1)
    m, l, acc = _blocks(_empty_state(bq, parts), q, k_ref, v_ref, first, pt_ref[first, :], kvh, sc_ref[0],
                        kv_dtype, 0, nb_ref[first], compiled=compiled)
    dest = jnp.where(real, seq_c * n_heads + heads, n_seq * n_heads + r)  # padding: out of range (see above)
    pltriton.store(m_ref.at[dest], m, mask=real)
    pltriton.store(l_ref.at[dest], l, mask=real)
    _store_rows(acc_ref, (), dest, real, parts, acc)


def shared_prefix_tiles(page_table_BxNb, shared_blocks_B, per_tile: int):
  """-> (tiles (B, per_tile) int32, blocks (B,) int32): tiles of sequences that share their first key blocks.
  Sequence b's first ``shared_blocks_B[b]`` pages are the same pages for every sequence with the same first page
  and the same count (the caller's promise: the sampler's prompt pages). Sequences are grouped by (first page,
  count) and each group cut into tiles of ``per_tile``; -1 pads a tile, and tiles past the last are all -1.
  ``blocks`` is the count the two passes use: 0 for a sequence alone in its group (nothing to share: its decode
  tile reads everything, as without the pass) and for sequences with no shared block (tiles of their own)."""
  b, nb = page_table_BxNb.shape
  idx = jnp.arange(b, dtype=jnp.int32)
  n = shared_blocks_B.astype(jnp.int32)
  key = jnp.where(n > 0, page_table_BxNb[:, 0].astype(jnp.int32) * (nb + 1) + n, -1 - idx)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  ks = key[order]
  new_group = jnp.concatenate([jnp.ones((1,), bool), ks[1:] != ks[:-1]])
  within = idx - lax.cummax(jnp.where(new_group, idx, 0))
  tile = jnp.cumsum(new_group | (within % per_tile == 0)) - 1
  group = jnp.cumsum(new_group) - 1
  size = jnp.zeros((b,), jnp.int32).at[group].add(1)[group]  # sequences in each one's group, in sorted order
  blocks = jnp.zeros((b,), jnp.int32).at[order].set(jnp.where(size > 1, n[order], 0))
  return jnp.full((b, per_tile), -1, jnp.int32).at[tile, within % per_tile].set(order), blocks


def _scalars(qk_scale, v_scale):
  return jnp.stack([jnp.asarray(qk_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])


def _params(num_warps, num_stages):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _pad_rows(x, axis: int, multiple: int, value=0):
  n = x.shape[axis]
  pad = -(-n // multiple) * multiple - n
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _keys(k, v, page_table):
  """(k, v, extra operands, key blocks per sequence): dense caches padded to whole blocks, or page pools as they are."""
  if page_table is None:
    k, v = pad_keys(k, BLOCK_KV), pad_keys(v, BLOCK_KV)
    return k, v, (), k.shape[1] // BLOCK_KV
  nb = page_table.shape[1]
  width = 1 << max(0, (nb - 1).bit_length())  # the kernel loads a row as one vector: a power of two (pad: page 0)
  return k, v, (jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - nb))),), nb


@functools.partial(jax.jit, static_argnames=("config", "interpret", "pair_ordered"))
def attention_seq(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, qk_scale, v_scale, page_table_BxNb=None, *,
                  config: TuningConfig = TuningConfig(), interpret: bool = False, pair_ordered: bool = False):
  """Rows = positions of one head (training, prefill) -> (out_BxTxHxD, lse_BxHxT FP32, log2 units).

  ``page_table_BxNb``: k/v are page pools (N, BLOCK_KV, K, D) (the paged form of ``pallas_kernels.attention``).
  ``pair_ordered``: k/v are float8_e4m3fn codes in pair order (``pallas_kernels.attention.pair_order``: the FP8
  cache's layout), read as uint16 carriers."""
  check_operands(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, page_table_BxNb, BLOCK_KV)
  b, t, h, d = q_BxTxHxD.shape
  g = h // k_BxSxKxD.shape[2]
  q = _pad_rows(q_BxTxHxD, 1, BLOCK_KV)
  pos = _pad_rows(q_pos_BxT.astype(jnp.int32), 1, BLOCK_KV, -1)
  k, v, extra, n_kb = _keys(*_kv_form(k_BxSxKxD, v_BxSxKxD, pair_ordered), page_table_BxNb)
  tp = q.shape[1]
  out, lse = pl.pallas_call(
      functools.partial(_seq_fwd_kernel, g=g, n_kb=n_kb, bq=config.block_q, paged=bool(extra), compiled=not interpret),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, tp), jnp.float32)),
      grid=(b, h, tp // config.block_q),
      compiler_params=_params(config.num_warps, config.num_stages),
      interpret=interpret, name="fp8jax_attention_seq",
  )(q, k, v, pos, _scalars(qk_scale, v_scale), *extra)
  return out[:, :t], lse[:, :, :t]


def _kv_form(k, v, pair_ordered: bool):
  """K/V as the kernels read them: pair-ordered FP8 codes as uint16 carriers (a bitcast: byte pairs of each row,
  ``_unpack_carriers``), anything else as it is."""
  if not pair_ordered:
    return k, v
  if k.dtype != jnp.float8_e4m3fn or v.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"pair_ordered=True takes float8_e4m3fn codes, got k {k.dtype}, v {v.dtype}")
  carriers = lambda x: lax.bitcast_convert_type(  # noqa: E731
      lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint16)
  return carriers(k), carriers(v)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "pair_ordered"))
def attention_heads(q_BxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_B, qk_scale, v_scale, page_table_BxNb=None,
                    shared_blocks_B=None, *, config: TuningConfig = TuningConfig(), interpret: bool = False,
                    pair_ordered: bool = False):
  """One query per sequence (decode): rows = the G heads of each key/value head -> out_BxHxD.

  ``page_table_BxNb``: k/v are page pools (N, BLOCK_KV, K, D) (the paged form of ``pallas_kernels.attention``).
  ``shared_blocks_B`` (paged form only): sequence b's first shared_blocks_B[b] key blocks are pages it shares with
  every sequence of the same first page and count (the G samples of a prompt; each sees those blocks in full). A
  prefix pass then runs each group's shared blocks once, its sequences' rows together in one tile (up to
  ``prefix_rows`` / G sequences per tile: one read of the prefix pages per tile, no padding rows), and the decode
  tiles go on from the state it leaves. Same blocks, same order, same update per row: the same bits as without it.
  ``pair_ordered``: as in ``attention_seq`` (the sampler's FP8 cache). E4M3 codes in natural order take the 64-row
  tile (``TuningConfig.decode_block_q_natural_fp8``): a smaller one would not give the training rows' bits."""
  b, h, d = q_BxHxD.shape
  check_operands(q_BxHxD[:, None], k_BxSxKxD, v_BxSxKxD, q_pos_B[:, None], page_table_BxNb, BLOCK_KV)
  n_kv = k_BxSxKxD.shape[2]
  g = h // n_kv
  fp8 = k_BxSxKxD.dtype == jnp.float8_e4m3fn
  bq = config.decode_block_q_natural_fp8 if fp8 and not pair_ordered else config.decode_block_q
  k, v, extra, n_kb = _keys(*_kv_form(k_BxSxKxD, v_BxSxKxD, pair_ordered), page_table_BxNb)
  scalars = _scalars(qk_scale, v_scale)
  if not fp8:
    stages = config.decode_num_stages_bf16
  else:
    stages = config.decode_num_stages if pair_ordered else config.decode_num_stages_natural_fp8
  params = _params(config.decode_num_warps, stages)
  shared = shared_blocks_B is not None
  if shared:
    if page_table_BxNb is None:
      raise ValueError("attention_heads: shared_blocks_B needs the paged form (page_table_BxNb)")
    if shared_blocks_B.shape != (b,):
      raise ValueError(f"attention_heads: shared_blocks_B must be ({b},) for q {q_BxHxD.shape}, got "
                       f"{shared_blocks_B.shape}")
    pq = prefix_rows(config, g, natural_fp8=fp8 and not pair_ordered)
    if g > pq:
      raise ValueError(f"attention_heads: shared_blocks_B needs G = {g} query heads per key/value head <= "
                       f"prefix_block_q = {pq} (one tile holds whole sequences)")
    per_tile = pq // g
    tiles, nb = shared_prefix_tiles(page_table_BxNb, shared_blocks_B, per_tile)
    f32 = jnp.float32
    shapes = (jax.ShapeDtypeStruct((b * h,), f32), jax.ShapeDtypeStruct((b * h,), f32),
              jax.ShapeDtypeStruct((b * h, d), f32))
    prefix = pl.pallas_call(
        functools.partial(_prefix_kernel, g=g, bq=pq, per_tile=per_tile, compiled=not interpret), out_shape=shapes,
        grid=(b, n_kv),
        compiler_params=_params(config.prefix_num_warps, config.prefix_num_stages), interpret=interpret,
        name="fp8jax_attention_decode_prefix")
    # Always launched: with no group of two or more (e.g. one sample per prompt) every tile is -1 and every program
    # returns at once, leaving the state unwritten, which the decode tiles never read then (they start at block 0
    # where nb is 0 and select the empty state). Not a lax.cond: on the GPU a conditional copies its predicate to
    # the host and waits, once per layer and decode step, and the GPU idles while the next kernels are launched.
    state = prefix(q_BxHxD, k, v, tiles, nb, scalars, *extra)
    extra = (*extra, nb, *state)
  return pl.pallas_call(
      functools.partial(_heads_fwd_kernel, g=g, n_kb=n_kb, bq=bq, paged=page_table_BxNb is not None, shared=shared,
                        compiled=not interpret),
      out_shape=jax.ShapeDtypeStruct(q_BxHxD.shape, q_BxHxD.dtype), grid=(b, n_kv, -(-g // bq)),
      compiler_params=params, interpret=interpret, name="fp8jax_attention_decode",
  )(q_BxHxD, k, v, q_pos_B.astype(jnp.int32), scalars, *extra)


# ------------------------------------------------------------------------------------------------------------------
# Backward (training form: keys are the queries' own sequence)
# ------------------------------------------------------------------------------------------------------------------


def _probs_and_ds(qs, ks, vb, do, lse, delta, key, pos, qk_scale, v_scale, compiled: bool):
  """P and dS (natural-log softmax gradient, before the score scale) of one (rows x keys) block, from the row lse.

  ``qs``, ``ks``: the forward's score operands (FP16 for E4M3 codes, ``ks`` then read from the FP16 copy of K).
  P = 2**(raw * qk_scale - lse) as the forward forms it (``_exp2_scaled``)."""
  s = lax.dot_general(qs, ks, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  vis = key[None, :] <= pos[:, None]
  p = jnp.where(vis, _exp2_scaled(s, qk_scale, lse[:, None], compiled), 0.0)
  dp = lax.dot_general(do, vb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * v_scale
  return p, p * (dp - delta[:, None])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, pos_ref, sc_ref, ks_ref, dq_ref, *, g, n_kb, bq, bkv,
               codes, compiled):
  b, h, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  kvh = lax.div(h, g)
  rows = pl.ds(pl.multiple_of(ti * bq, bq), bq)
  q, do, pos = q_ref[b, rows, h, :], do_ref[b, rows, h, :], pos_ref[b, rows]
  lse, delta = lse_ref[b, h, rows], delta_ref[b, h, rows]
  qk_scale, v_scale = sc_ref[0], sc_ref[1]
  qs = _fp16(q) if codes else q  # the forward's score operand, converted once
  n = jnp.minimum(lax.div(jnp.max(pos) + bkv, bkv), n_kb * (BLOCK_KV // bkv))

  def body(j, dq):
    start = pl.multiple_of(j * bkv, bkv)
    kb = k_ref[b, pl.ds(start, bkv), kvh, :]
    ks = ks_ref[b, pl.ds(start, bkv), kvh, :] if codes else kb  # codes: K's FP16 copy (loaded, not converted)
    vb = v_ref[b, pl.ds(start, bkv), kvh, :]
    key = start + lax.broadcasted_iota(jnp.int32, (bkv,), 0)
    _, ds = _probs_and_ds(qs, ks, vb, do, lse, delta, key, pos, qk_scale, v_scale, compiled)
    return dq + lax.dot_general(ds.astype(kb.dtype), kb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  dq = lax.fori_loop(0, n, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[b, rows, h, :] = (dq * sc_ref[2]).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, pos_ref, sc_ref, ks_ref, dk_ref, dv_ref, *, g, n_qt,
                bq, bkv, causal_rows: bool, codes: bool, compiled: bool):
  b, kvh, ki = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start = pl.multiple_of(ki * bkv, bkv)
  keys = pl.ds(start, bkv)
  kb, vb = k_ref[b, keys, kvh, :], v_ref[b, keys, kvh, :]
  ks = ks_ref[b, keys, kvh, :] if codes else kb
  key = start + lax.broadcasted_iota(jnp.int32, (bkv,), 0)
  qk_scale, v_scale = sc_ref[0], sc_ref[1]
  # Training rows are at positions 0..T-1 in order, so query tiles before this key block see none of it.
  lo = lax.div(start, bq) if causal_rows else 0

  def head(gi, acc):
    h = kvh * g + gi

    def tile(ti, acc):
      dk, dv = acc
      rows = pl.ds(pl.multiple_of(ti * bq, bq), bq)
      q, do, pos = q_ref[b, rows, h, :], do_ref[b, rows, h, :], pos_ref[b, rows]
      p, ds = _probs_and_ds(_fp16(q) if codes else q, ks, vb, do, lse_ref[b, h, rows], delta_ref[b, h, rows], key,
                            pos, qk_scale, v_scale, compiled)
      dv = dv + lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
      dk = dk + lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
      return dk, dv

    return lax.fori_loop(lo, n_qt, tile, acc)

  zeros = jnp.zeros(kb.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, g, head, (zeros, zeros))
  dk_ref[b, keys, kvh, :] = (dk * sc_ref[2]).astype(dk_ref.dtype)
  dv_ref[b, keys, kvh, :] = (dv * v_scale).astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("causal_rows", "kv_codes", "config", "interpret"))
def attention_seq_bwd(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, q_pos_BxT, qk_scale, v_scale, out_BxTxHxD, lse_BxHxT, do_BxTxHxD,
                      *, causal_rows: bool, kv_codes: bool = False, config: TuningConfig = TuningConfig(),
                      interpret: bool = False):
  """(dq, dk, dv) of ``attention_seq``'s output for cotangent ``do`` (scales are constants: no gradient).

  ``causal_rows``: the rows are at positions 0..T-1 in order (training), so the dK/dV kernel skips query tiles
  before each key block. dq = ln-domain score scale (qk_scale / log2 e) x dS K; dk likewise; dv = v_scale P^T dO.
  ``kv_codes``: k/v are E4M3 codes held in q's dtype, whose forward ran on FP16 operands (``attention_seq`` over
  the codes as float16): the scores are recomputed on those operands, so P matches the forward's lse; the
  gradient dots stay in q's dtype (FP16 would underflow small cotangents).
  """
  b, t, h, d = q_BxTxHxD.shape
  g = h // k_BxSxKxD.shape[2]
  cfg = config
  delta = jnp.einsum("bthd,bthd->bht", out_BxTxHxD.astype(jnp.float32), do_BxTxHxD.astype(jnp.float32))
  q, do = (_pad_rows(x, 1, BLOCK_KV) for x in (q_BxTxHxD, do_BxTxHxD))
  pos = _pad_rows(q_pos_BxT.astype(jnp.int32), 1, BLOCK_KV, -1)
  lse, delta = (_pad_rows(x, 2, BLOCK_KV) for x in (lse_BxHxT, delta))
  k, v = pad_keys(k_BxSxKxD, BLOCK_KV), pad_keys(v_BxSxKxD, BLOCK_KV)
  tp, sp = q.shape[1], k.shape[1]
  ln_scale = jnp.asarray(qk_scale, jnp.float32) * jnp.float32(1 / 1.4426950408889634)
  sc = jnp.stack([jnp.asarray(qk_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32), ln_scale])
  # The score operand K: K itself, or (codes) its FP16 copy as a separate input, so that no kernel converts a K
  # block that it also uses in BF16 (converting the dQ kernel's K block in registers gave wrong dQ on the H200).
  args = (q, k, v, do, lse, delta, pos, sc, k.astype(jnp.float16) if kv_codes else k)
  params = _params(cfg.bwd_num_warps, cfg.bwd_num_stages)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, g=g, n_kb=sp // BLOCK_KV, bq=cfg.bwd_block_q, bkv=cfg.bwd_block_kv,
                        codes=kv_codes, compiled=not interpret),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(b, h, tp // cfg.bwd_block_q),
      compiler_params=params, interpret=interpret, name="fp8jax_attention_dq",
  )(*args)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, g=g, n_qt=tp // cfg.bwd_block_q, bq=cfg.bwd_block_q, bkv=cfg.bwd_block_kv,
                        causal_rows=causal_rows, codes=kv_codes, compiled=not interpret),
      out_shape=(jax.ShapeDtypeStruct(k.shape, q.dtype),) * 2, grid=(b, k.shape[2], sp // cfg.bwd_block_kv),
      compiler_params=params, interpret=interpret, name="fp8jax_attention_dkv",
  )(*args)
  s = k_BxSxKxD.shape[1]
  return dq[:, :t], dk[:, :s].astype(k_BxSxKxD.dtype), dv[:, :s].astype(v_BxSxKxD.dtype)
