"""The attention op (fp8jax.attention) and its kernels (pallas_kernels.attention_triton) against the reference.

CPU (CI): the blocked reference against textbook softmax attention; decode rows == training rows bit for bit through
``attend`` (BF16 and FP8 K/V, stale and NaN cache rows); the kernels in interpret mode against the reference
(forward: training/prefill rows and decode rows, GQA, ragged lengths, padding and length-1 rows, both K/V forms;
backward: dq, dk, dv against autodiff of the reference) and decode == training bitwise; the paged cache form (pages
in any order of a pool) bitwise the dense one; ``attend`` per device on 4 fake devices (dense and paged); lowering
for the ``cuda`` platform (Pallas -> Triton IR for an abstract H200); backend selection and errors.
GPU (``-m gpu``): the compiled kernels against the reference, bitwise decode == training for random batches and
lengths, gradients against the reference's.

Error bounds (relative Frobenius norm ||out - ref|| / ||ref||):
* blocked reference vs textbook FP32 attention: <= 1e-2 (P is rounded to BF16 before the P.V dot, the output to
  BF16: each ~2**-9 relative);
* kernel vs reference on the same operands: <= 5e-3 (the same math; the output's BF16 rounding can flip by one ulp
  where FP32 sums differ in order; on the GPU also exp2.approx);
* backward vs autodiff of the reference: <= 2e-2 (P and dS are rounded to BF16 before their dots in both, at
  different points; measured ~4e-3 in interpret mode).
"""

from __future__ import annotations

import functools
import types
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import attention as attn
from fp8jax import backends, kvcache
from pallas_kernels import attention as ref
from pallas_kernels import attention_triton as kern
from pallas_kernels.lowering import lower_for_h200
import child_process  # tests/child_process.py

requires_gpu = pytest.mark.skipif(not attn._gpu_available(), reason="needs a CUDA GPU")


def _rel(out, want) -> float:
  out, want = (jnp.asarray(x, jnp.float32) for x in (out, want))
  return float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))


def _qkv(seed, b, t, h, kv, d, s=None, fp8=False):
  """Fresh random q (BF16) and k/v: BF16 values, or E4M3 codes with scales (as the FP8 KV recipe makes them)."""
  s = s or t
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(k1, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(k2, (b, s, kv, d), jnp.float32) * 2
  v = jax.random.normal(k3, (b, s, kv, d), jnp.float32)
  if not fp8:
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None
  ks, vs = jnp.float32(8 / 448), jnp.float32(4 / 448)
  return q, kvcache.quantize_kv(k, ks), kvcache.quantize_kv(v, vs), ks, vs


def _scales(d, ks, vs):
  return attn._scales(d, ks, vs)


# ------------------------------------------------------------------------------------------------------------------
# CPU: the reference
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,t,h,kv,d,fp8", [(2, 37, 4, 2, 64, False), (1, 300, 8, 2, 128, True),
                                            (3, 1, 2, 1, 128, False), (2, 130, 6, 6, 64, True)])
def test_reference_matches_textbook_attention(b, t, h, kv, d, fp8):
  q, k, v, ks, vs = _qkv(t + h, b, t, h, kv, d, fp8=fp8)
  qs, vsc = _scales(d, ks, vs)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  out, lse = ref.attention_reference(q, k, v, pos, qs, vsc)
  want = ref.attention_dense(q, k.astype(jnp.float32), v.astype(jnp.float32), pos, qs, vsc)
  assert out.dtype == jnp.bfloat16 and lse.shape == (b, h, t)
  assert _rel(out, want) <= 1e-2


def test_reference_rows_that_see_nothing_are_zero_and_others_unaffected():
  q, k, v, _, _ = _qkv(0, 2, 20, 4, 2, 64)
  qs, vs = _scales(64, None, None)
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20)).at[0, 3].set(-1)
  out, lse = ref.attention_reference(q, k, v, pos, qs, vs)
  assert np.all(np.asarray(out[0, 3]) == 0) and np.all(np.isinf(np.asarray(lse[0, :, 3])))
  full, _ = ref.attention_reference(q, k, v, jnp.broadcast_to(jnp.arange(20), (2, 20)), qs, vs)
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(full[1]))


def _cache_with_stale_rows(k, v, s, seed):
  """A slot cache of length s holding k/v at 0..T-1 and stale garbage after (NaN in V: must never leak)."""
  b, t, kv, d = k.shape
  junk = jax.random.normal(jax.random.key(seed), (b, s, kv, d), jnp.float32) * 50
  ck = junk.astype(k.dtype).at[:, :t].set(k)
  cv = jnp.full((b, s, kv, d), jnp.nan, jnp.float32).astype(v.dtype).at[:, :t].set(v)
  return ck, cv


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_decode_and_prefill_rows_equal_training_rows_bitwise(fp8):
  """The contract's promise through ``attend`` on the reference backend (CPU): the sampler's rows are the trainer's.

  Training sees the FP8 K/V as BF16 code values (kv_codes), decode reads the float8 cache: the same numbers.
  """
  b, t, h, kv, d = 3, 200, 8, 2, 128
  q, k, v, ks, vs = _qkv(1, b, t, h, kv, d, fp8=fp8)
  train_k, train_v = (k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  full = fp8jax.jit(lambda q, k, v: attn.attend(q, k, v, k_scale=ks, v_scale=vs, backend="xla"))(q, train_k, train_v)
  ck, cv = _cache_with_stale_rows(k, v, 384, 2)
  step = fp8jax.jit(lambda q, k, v, p: attn.attend(q, k, v, p, k_scale=ks, v_scale=vs, backend="xla"))
  rng = np.random.default_rng(0)
  for p in [0, 1, 127, 128, 129, t - 1, *rng.integers(0, t, 4)]:
    np.testing.assert_array_equal(np.asarray(step(q[:, p:p + 1], ck, cv, jnp.full((b, 1), p))),
                                  np.asarray(full[:, p:p + 1]), err_msg=f"position {p}")
  # ragged rows: each sequence decodes at its own position in one call
  ps = jnp.asarray(rng.integers(0, t, b), jnp.int32)
  rows = step(q[jnp.arange(b), ps][:, None], ck, cv, ps[:, None])
  np.testing.assert_array_equal(np.asarray(rows[:, 0]), np.asarray(full[jnp.arange(b), ps]))
  # prefill: the first 150 positions against the cache
  pre = step(q[:, :150], ck, cv, jnp.broadcast_to(jnp.arange(150), (b, 150)))
  np.testing.assert_array_equal(np.asarray(pre), np.asarray(full[:, :150]))


def test_decode_rows_equal_training_rows_at_a_shape_where_vectorized_xla_cpu_rounds_differently():
  """Regression: with all rows vectorized, XLA:CPU gave row (3, 699), head 5 of this 4 x 700 batch a different l
  (one FP32 ulp, one BF16 output ulp) than the same row decoded alone; the fixed-shape row tiles fix it."""
  q = jax.random.normal(jax.random.key(0), (4, 700, 32, 128), jnp.bfloat16)
  kv = jax.random.normal(jax.random.key(1), (4, 700, 8, 128), jnp.bfloat16)
  train = fp8jax.jit(lambda q, k, v: attn.attend(q, k, v, backend="xla"))(q, kv, kv)
  cache = jnp.zeros((4, kvcache.padded_len(700), 8, 128), jnp.bfloat16).at[:, :700].set(kv)
  dec = fp8jax.jit(lambda q, k, v, p: attn.attend(q, k, v, p, backend="xla"))(q[:, -1:], cache, cache,
                                                                             jnp.full((4, 1), 699))
  np.testing.assert_array_equal(np.asarray(dec), np.asarray(train[:, -1:]))


def _shuffled_pages(ck, cv, block: int, seed: int):
  """The dense caches as pages in a random order of a pool with extra stale (NaN) pages, and their page table."""
  (kp, table), (vp, _) = ref.as_pages(ck, block), ref.as_pages(cv, block)
  n = kp.shape[0]
  perm = np.random.default_rng(seed).permutation(n + 3)  # slot of each page in the pool; 3 pages nobody reads
  nan = jnp.full((n + 3, *kp.shape[1:]), jnp.nan, kp.dtype)
  pool_k, pool_v = nan.at[perm[:n]].set(kp), nan.at[perm[:n]].set(vp)
  return pool_k, pool_v, jnp.asarray(perm[np.asarray(table)], jnp.int32)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_paged_rows_equal_dense_rows_bitwise(fp8):
  """The paged form (pages in any order of a pool, stale NaN pages around) reads the same blocks in the same order
  as the dense cache: decode and prefill rows are bit for bit the dense ones (reference backend, CPU)."""
  b, t, h, kv, d = 3, 90, 8, 2, 64
  q, k, v, ks, vs = _qkv(11, b, t, h, kv, d, fp8=fp8)
  ck, cv = _cache_with_stale_rows(k, v, 128, 1)
  pk, pv, table = _shuffled_pages(ck, cv, ref.key_block(), 0)
  step = fp8jax.jit(lambda q, k, v, p, pt=None: attn.attend(q, k, v, p, k_scale=ks, v_scale=vs, backend="xla",
                                                           page_table=pt))
  ps = jnp.asarray([0, 17, t - 1], jnp.int32)
  qd = q[jnp.arange(b), ps][:, None]
  np.testing.assert_array_equal(np.asarray(step(qd, pk, pv, ps[:, None], table)),
                                np.asarray(step(qd, ck, cv, ps[:, None])))
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  np.testing.assert_array_equal(np.asarray(step(q, pk, pv, pos, table)), np.asarray(step(q, ck, cv, pos)))
  # writing through the table lands where the dense write does
  new = jax.random.normal(jax.random.key(5), (b, 1, kv, d), jnp.float32).astype(ck.dtype)
  dense = kvcache.write(ck, new, ps[:, None])
  paged = kvcache.write(pk, new, ps[:, None], table)
  np.testing.assert_array_equal(np.asarray(ref.dense_view(paged, table), np.float32), np.asarray(dense, np.float32))


# ------------------------------------------------------------------------------------------------------------------
# CPU: the kernels in interpret mode
# ------------------------------------------------------------------------------------------------------------------


SEQ_CASES = [  # (b, t, h, kv, d, fp8, s): s > t is a prefill against a longer cache
    (1, 1, 2, 1, 128, False, None),
    (2, 75, 4, 2, 64, False, None),
    (1, 200, 4, 1, 128, True, None),
    (2, 60, 2, 2, 128, True, 256),
]


@pytest.mark.parametrize("b,t,h,kv,d,fp8,s", SEQ_CASES)
def test_seq_kernel_interpret_matches_reference(b, t, h, kv, d, fp8, s):
  q, k, v, ks, vs = _qkv(7 * t + d, b, t, h, kv, d, s=s, fp8=fp8)
  qs, vsc = _scales(d, ks, vs)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  if b > 1:
    pos = pos.at[1, t // 2].set(-1)  # a padding row: sees nothing, output 0
  out, lse = kern.attention_seq(q, k, v, pos, qs, vsc, interpret=True)
  want, want_lse = ref.attention_reference(q, k, v, pos, qs, vsc)
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, t)
  assert _rel(out, want) <= 5e-3
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=1e-5, atol=1e-5)
  assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
  if b > 1:
    assert np.all(np.asarray(out[1, t // 2]) == 0)


@pytest.mark.parametrize("g", [1, 4, 70], ids=["g1", "g4", "g70-two-tiles"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_decode_kernel_interpret_matches_reference_and_training_rows(g, fp8):
  b, t, kv, d = 3, 150, 2, 64 if g == 70 else 128
  h = g * kv
  q, k, v, ks, vs = _qkv(g, b, t, h, kv, d, fp8=fp8)
  qs, vsc = _scales(d, ks, vs)
  held = jnp.float16 if fp8 else jnp.bfloat16  # the trainer's codes reach the kernel as FP16 (fp8jax.attention)
  train, _ = kern.attention_seq(q, k.astype(held), v.astype(held), jnp.broadcast_to(jnp.arange(t), (b, t)), qs, vsc,
                                interpret=True)
  ck, cv = _cache_with_stale_rows(k, v, 256, 3)
  ps = jnp.asarray([0, 128, t - 1], jnp.int32)
  out = kern.attention_heads(q[jnp.arange(b), ps], ck, cv, ps, qs, vsc, interpret=True)
  want, _ = ref.attention_reference(q[jnp.arange(b), ps][:, None], ck, cv, ps[:, None], qs, vsc)
  assert out.shape == (b, h, d) and np.all(np.isfinite(np.asarray(out)))
  assert _rel(out, want[:, 0]) <= 5e-3
  np.testing.assert_array_equal(np.asarray(out), np.asarray(train[jnp.arange(b), ps]))


def test_codes_take_fp16_operands_interpret():
  """E4M3 codes take the contract's FP16 operands: the kernel over float8 codes == over the same codes held in
  float16, bitwise; decode rows == training rows; the reference with ``kv_codes`` (float8, or BF16-held codes with
  the flag: the trainer's form) is the same math, closer to the kernel than the BF16-operand reference; codes held
  in BF16 without the flag are BF16 values (other bits)."""
  b, t, h, kv, d = 2, 150, 8, 2, 128
  q, k, v, ks, vs = _qkv(11, b, t, h, kv, d, fp8=True)
  qs, vsc = _scales(d, ks, vs)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  train, _ = kern.attention_seq(q, k, v, pos, qs, vsc, interpret=True)
  train16, _ = kern.attention_seq(q, k.astype(jnp.float16), v.astype(jnp.float16), pos, qs, vsc, interpret=True)
  np.testing.assert_array_equal(np.asarray(train), np.asarray(train16))
  ck, cv = _cache_with_stale_rows(k, v, 256, 5)
  ps = jnp.asarray([3, t - 1], jnp.int32)
  dec = kern.attention_heads(q[jnp.arange(b), ps], ck, cv, ps, qs, vsc, interpret=True)
  np.testing.assert_array_equal(np.asarray(dec), np.asarray(train[jnp.arange(b), ps]))
  kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  want, _ = ref.attention_reference(q, k, v, pos, qs, vsc)
  np.testing.assert_array_equal(np.asarray(ref.attention_reference(q, kb, vb, pos, qs, vsc, kv_codes=True)[0]),
                                np.asarray(want))
  want_bf16_operands, _ = ref.attention_reference(q, kb, vb, pos, qs, vsc)
  assert _rel(train, want) <= 1e-3 and _rel(train, want) < _rel(train, want_bf16_operands)
  bf16_ops, _ = kern.attention_seq(q, kb, vb, pos, qs, vsc, interpret=True)
  assert not np.array_equal(np.asarray(train), np.asarray(bf16_ops))


def _prompt_groups(seed, groups, own_blocks, h, kv, d, fp8):
  """A page pool where the sequences of each group (sizes ``groups[i][0]``) share their first ``groups[i][1]`` pages
  (a prompt's, written once) and then read ``own_blocks`` pages of their own; pages in a random pool order with
  stale NaN pages around. -> (q_BxHxD, pool k, pool v, table, positions (each past its shared blocks), shared_B,
  scales)."""
  rng = np.random.default_rng(seed)
  bk = ref.BLOCK_KV
  b = sum(n for n, _ in groups)
  n_pages = sum(nb for _, nb in groups) + b * own_blocks + 3
  perm = rng.permutation(n_pages)
  q, k, v, ks, vs = _qkv(seed, n_pages, bk, 1, kv, d, fp8=fp8)  # one random page per pool entry
  q = jax.random.normal(jax.random.key(seed + 1), (b, h, d), jnp.float32).astype(jnp.bfloat16)
  nan = jnp.full(k.shape, jnp.nan, jnp.float32).astype(v.dtype)
  v = v.at[perm[-3:]].set(nan[:3])
  rows, shared, nxt = [], [], 0
  for n, nb in groups:
    prompt = list(perm[nxt:nxt + nb])
    nxt += nb
    for _ in range(n):
      rows.append(prompt + list(perm[nxt:nxt + own_blocks]))
      shared.append(nb)
      nxt += own_blocks
  width = max(len(r) for r in rows)
  table = jnp.asarray([r + [r[-1]] * (width - len(r)) for r in rows], jnp.int32)
  pos = jnp.asarray([int(rng.integers(nb * bk, (nb + own_blocks) * bk)) for nb in shared], jnp.int32)
  return q, k, v, table, pos, jnp.asarray(shared, jnp.int32), _scales(d, ks, vs)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_shared_prefix_decode_interpret_equals_plain_decode_bitwise(fp8):
  """The shared-prefix pass (a prompt's blocks once, its samples' rows in one tile) + the decode tiles resuming from
  its state == the plain decode tiles, bit for bit: groups larger than a tile (cut in two), of one, a sequence with
  no shared block, rows ordered across groups."""
  groups = [(5, 2), (1, 1), (3, 3), (2, 0), (1, 2)]  # (sequences, shared blocks); 2 with 2 blocks: different pages
  q, k, v, table, pos, shared, (qs, vsc) = _prompt_groups(3 + fp8, groups, 2, 8, 2, 64, fp8)
  perm = np.random.default_rng(0).permutation(q.shape[0])  # a group's sequences need not be adjacent
  q, table, pos, shared = q[perm], table[perm], pos[perm], shared[perm]
  cfg = kern.TuningConfig(prefix_block_q=16)  # 4 sequences of G = 4 heads per prefix tile
  plain = kern.attention_heads(q, k, v, pos, qs, vsc, table, config=cfg, interpret=True)
  got = kern.attention_heads(q, k, v, pos, qs, vsc, table, shared, config=cfg, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  want = ref.attention_reference(q[:, None], k, v, pos[:, None], qs, vsc, block_kv=ref.BLOCK_KV, page_table_BxNb=table,
                                 kv_codes=fp8)[0][:, 0]
  assert _rel(got, want) <= 5e-3
  # One sample per prompt: no group of two, every prefix tile empty (the pass writes no state, the decode tiles start
  # at block 0 and never read it): the same rows.
  q, k, v, table, pos, shared, _ = _prompt_groups(5, [(1, 2), (1, 1), (1, 3)], 2, 8, 2, 64, fp8)
  np.testing.assert_array_equal(
      np.asarray(kern.attention_heads(q, k, v, pos, qs, vsc, table, shared, config=cfg, interpret=True)),
      np.asarray(kern.attention_heads(q, k, v, pos, qs, vsc, table, config=cfg, interpret=True)))


def test_shared_prefix_tiles_group_sequences_by_prefix():
  """Tiles hold only sequences of one (first page, shared count) group, each sequence exactly once, at most
  ``per_tile`` per tile; sequences without shared blocks alone."""
  table = jnp.asarray([[7, 1], [3, 2], [7, 4], [7, 5], [3, 6], [7, 8], [9, 0], [7, 9]], jnp.int32)
  shared = jnp.asarray([2, 1, 2, 2, 1, 2, 0, 1], jnp.int32)  # seq 7 shares page 7 but 1 block: its own group
  tiles, blocks = kern.shared_prefix_tiles(table, shared, 3)
  tiles = np.asarray(tiles)
  got = sorted(tuple(sorted(int(x) for x in t if x >= 0)) for t in tiles if (t >= 0).any())
  assert got == [(0, 2, 3), (1, 4), (5,), (6,), (7,)]
  assert np.all(tiles[len(got):] == -1)
  # the passes' block counts: a sequence alone in its group (7) shares nothing, reads everything itself
  np.testing.assert_array_equal(np.asarray(blocks), [2, 1, 2, 2, 1, 2, 0, 0])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-kv", "fp8-kv"])
def test_paged_kernels_interpret_equal_dense_kernels_bitwise(fp8):
  """The kernels' paged form (decode and prefill tiles reading pages through the table) == their dense form."""
  b, t, h, kv, d = 2, 200, 8, 2, 64
  q, k, v, ks, vs = _qkv(13, b, t, h, kv, d, fp8=fp8)
  qs, vsc = _scales(d, ks, vs)
  ck, cv = _cache_with_stale_rows(k, v, 384, 4)
  pk, pv, table = _shuffled_pages(ck, cv, ref.BLOCK_KV, 1)
  ps = jnp.asarray([130, t - 1], jnp.int32)
  dense = kern.attention_heads(q[jnp.arange(b), ps], ck, cv, ps, qs, vsc, interpret=True)
  paged = kern.attention_heads(q[jnp.arange(b), ps], pk, pv, ps, qs, vsc, table, interpret=True)
  np.testing.assert_array_equal(np.asarray(paged), np.asarray(dense))
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  dense_seq = kern.attention_seq(q, ck, cv, pos, qs, vsc, interpret=True)
  paged_seq = kern.attention_seq(q, pk, pv, pos, qs, vsc, table, interpret=True)
  for x, y in zip(paged_seq, dense_seq):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("b,t,h,kv,d,scale", [(2, 150, 4, 2, 128, 1.0), (1, 70, 2, 1, 64, 0.25)])
def test_backward_kernels_interpret_match_reference_gradients(b, t, h, kv, d, scale):
  q, k, v, _, _ = _qkv(t, b, t, h, kv, d)
  do = jax.random.normal(jax.random.key(99), q.shape, jnp.float32).astype(jnp.bfloat16)
  qs, vs = _scales(d, jnp.float32(scale), jnp.float32(1.5))
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  _, vjp = jax.vjp(lambda q, k, v: ref.attention_reference(q, k, v, pos, qs, vs)[0], q, k, v)
  want = vjp(do)
  out, lse = kern.attention_seq(q, k, v, pos, qs, vs, interpret=True)
  got = kern.attention_seq_bwd(q, k, v, pos, qs, vs, out, lse, do, causal_rows=True, interpret=True,
                               config=kern.TuningConfig(bwd_block_q=32, bwd_block_kv=64))
  for name, g_, w in zip(("dq", "dk", "dv"), got, want):
    assert g_.shape == w.shape and g_.dtype == w.dtype, name
    assert _rel(g_, w) <= 2e-2, (name, _rel(g_, w))


def test_backward_kernels_interpret_match_reference_gradients_for_codes():
  """The FP8 KV training form: BF16-held codes whose forward ran on FP16 operands; the backward recomputes the
  scores on those operands (``kv_codes``) and matches the reference's gradient with ``kv_codes``."""
  b, t, h, kv, d = 2, 150, 4, 2, 128
  q, k, v, ks, vs = _qkv(31, b, t, h, kv, d, fp8=True)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  do = jax.random.normal(jax.random.key(98), q.shape, jnp.float32).astype(jnp.bfloat16)
  qs, vsc = _scales(d, ks, vs)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  _, vjp = jax.vjp(lambda q, k, v: ref.attention_reference(q, k, v, pos, qs, vsc, kv_codes=True)[0], q, k, v)
  want = vjp(do)
  out, lse = kern.attention_seq(q, k.astype(jnp.float16), v.astype(jnp.float16), pos, qs, vsc, interpret=True)
  got = kern.attention_seq_bwd(q, k, v, pos, qs, vsc, out, lse, do, causal_rows=True, kv_codes=True, interpret=True)
  for name, g_, w in zip(("dq", "dk", "dv"), got, want):
    assert g_.shape == w.shape and g_.dtype == w.dtype == jnp.bfloat16, name
    assert _rel(g_, w) <= 2e-2, (name, _rel(g_, w))


def test_attend_is_differentiable_on_the_reference():
  q, k, v, _, _ = _qkv(3, 2, 40, 4, 2, 64)
  f = lambda q, k, v: jnp.sum(attn.attend(q, k, v, backend="xla").astype(jnp.float32) ** 2)  # noqa: E731
  g = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
  fd = lambda q, k, v: jnp.sum(ref.attention_dense(q, k, v, jnp.broadcast_to(jnp.arange(40), (2, 40)),  # noqa
                                                   *_scales(64, None, None)) ** 2)
  gd = jax.grad(fd, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
  for a, w in zip(g, gd):
    assert _rel(a, w) <= 3e-2


# ------------------------------------------------------------------------------------------------------------------
# CPU: lowering for cuda, backend selection, errors
# ------------------------------------------------------------------------------------------------------------------


def test_attend_sizes_the_prefix_tile_by_the_group(monkeypatch):
  """The default shared-prefix tile holds PREFIX_SEQS sequences' rows whatever G is (G = 32 here: 128 rows); through
  ``attend`` the pass runs and gives the plain decode's rows bit for bit."""
  assert [kern.prefix_rows(kern.TuningConfig(), g) for g in (1, 4, 8, 32, 64)] == [16, 16, 32, 128, 128]
  assert kern.prefix_rows(kern.TuningConfig(prefix_block_q=64), 4) == 64
  # over natural-order E4M3 codes never fewer rows than the decode tile (their bits depend on the tile)
  assert [kern.prefix_rows(kern.TuningConfig(), g, natural_fp8=True) for g in (1, 4, 32)] == [64, 64, 128]
  q, k, v, table, pos, sb, _ = _prompt_groups(21, [(3, 2), (2, 1)], 1, 32, 1, 64, True)
  seen = []

  def heads(*a, config, **kw):
    seen.append((a[7] is not None if len(a) > 7 else kw.get("shared_blocks_B") is not None,
                 kern.prefix_rows(config, 32)))
    return kern.attention_heads(*a, config=config, interpret=True, **kw)

  monkeypatch.setattr(attn, "_kernels", lambda: types.SimpleNamespace(
      TuningConfig=kern.TuningConfig, prefix_rows=kern.prefix_rows, attention_heads=heads))
  monkeypatch.setattr(attn, "resolve_backend", lambda requested, q, k: "pallas")
  kw = dict(k_scale=jnp.float32(1 / 30), v_scale=jnp.float32(1 / 30), page_table=table)
  got = attn.attend(q[:, None], k, v, pos[:, None], shared_blocks=sb, **kw)
  plain = attn.attend(q[:, None], k, v, pos[:, None], **kw)
  assert seen == [(True, 128), (False, 128)], seen
  np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-prefix"])
def test_pair_ordered_cache_interpret_equals_natural_bitwise(shared):
  """The FP8 cache in pair order (read as uint16 carriers, each unpacked into the two head-dim halves) gives the
  natural-order rows exactly: decode through a page table (with the shared-prefix pass), prefill over the pool, a
  dense cache; and ``attend``'s reference puts the order back.

  Both sides run 16-row tiles (natural-order codes take 64 on the GPU, ``decode_block_q_natural_fp8``, for the
  8-bit operand layout): in interpret mode XLA:CPU's dot may round a row differently with the tile's row count (seen
  on an Intel Xeon: one element of 5,632 one ulp off at 64 vs 16 rows), and this test is about the order, not the tile.
  """
  groups = [(5, 2), (1, 1), (3, 3), (2, 0)]
  q, k, v, table, pos, sb, (qs, vsc) = _prompt_groups(11, groups, 2, 8, 2, 64, True)
  pk, pv = ref.pair_order(k), ref.pair_order(v)
  np.testing.assert_array_equal(np.asarray(ref.natural_order(pk)).view(np.uint8), np.asarray(k).view(np.uint8))
  extra = (table, sb) if shared else (table,)
  cfg = kern.TuningConfig(prefix_block_q=16, decode_block_q_natural_fp8=16)
  want = kern.attention_heads(q, k, v, pos, qs, vsc, *extra, config=cfg, interpret=True)
  got = kern.attention_heads(q, pk, pv, pos, qs, vsc, *extra, config=cfg, interpret=True, pair_ordered=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.all(np.isfinite(np.asarray(got, np.float32)))
  if shared:
    return
  qp = jnp.broadcast_to(q[:, None], (q.shape[0], 20, *q.shape[1:]))  # prefill rows over the pool
  pp = jnp.broadcast_to(jnp.arange(20), (q.shape[0], 20))
  np.testing.assert_array_equal(
      np.asarray(kern.attention_seq(qp, pk, pv, pp, qs, vsc, table, interpret=True, pair_ordered=True)[0]),
      np.asarray(kern.attention_seq(qp, k, v, pp, qs, vsc, table, interpret=True)[0]))
  b, t = 2, 150
  q2, k2, v2, ks, vs = _qkv(4, b, t, 8, 2, 128, fp8=True)
  ck, cv = _cache_with_stale_rows(k2, v2, 256, 1)
  ps = jnp.asarray([0, t - 1], jnp.int32)
  qs2, vsc2 = _scales(128, ks, vs)
  dense = kern.attention_heads(q2[jnp.arange(b), ps], ck, cv, ps, qs2, vsc2, interpret=True)
  np.testing.assert_array_equal(
      np.asarray(kern.attention_heads(q2[jnp.arange(b), ps], ref.pair_order(ck), ref.pair_order(cv), ps, qs2, vsc2,
                                      interpret=True, pair_ordered=True)), np.asarray(dense))
  via_ref = attn.attend(q2[jnp.arange(b), ps][:, None], ref.pair_order(ck), ref.pair_order(cv), ps[:, None],
                        k_scale=ks, v_scale=vs, backend="xla", pair_ordered=True)
  np.testing.assert_array_equal(np.asarray(via_ref), np.asarray(attn.attend(
      q2[jnp.arange(b), ps][:, None], ck, cv, ps[:, None], k_scale=ks, v_scale=vs, backend="xla")))
  with pytest.raises(ValueError, match="pair_ordered=True takes float8_e4m3fn"):
    kern.attention_heads(q2[:, 0], k2.astype(jnp.bfloat16), v2.astype(jnp.bfloat16), ps, qs2, vsc2, interpret=True,
                         pair_ordered=True)


@pytest.mark.parametrize("form", ["bf16", "fp8-pairs"])
def test_decode_interpret_over_stale_pages_is_finite_and_a_slot_at_minus_one_is_zero(form):
  """Decode over a page pool, plain and through the shared-prefix pass: NaN in K and V past each slot's position on
  its own last page leaves every output finite, and a slot at position -1 (sees no key) gives zeros. Sequences of a
  group not adjacent, ragged positions."""
  fp8 = form != "bf16"
  groups = [(5, 2), (1, 1), (3, 3), (3, 0), (1, 2)]  # (sequences, shared blocks)
  q, k, v, table, pos, shared, (qs, vsc) = _prompt_groups(7 + fp8, groups, 2, 8, 2, 64, fp8)
  perm = np.asarray([0, 5, 1, 6, 7, 2, 3, 4, 8, 9, 10, 11, 12])  # groups interleaved; 11 stays in the 0-block group
  q, table, pos, shared = q[perm], table[perm], pos[perm], shared[perm]
  bk = ref.BLOCK_KV
  pos = pos.at[11].set(-1)  # in the group without shared blocks
  rows = np.arange(bk)
  for b_, p_ in enumerate(np.asarray(pos)):  # stale rows past each position on the slot's own last page
    if p_ >= 0:
      page = int(table[b_, p_ // bk])
      k, v = (x.at[page, rows[rows > p_ % bk]].set(jnp.nan) for x in (k, v))
  if fp8:
    k, v = ref.pair_order(k), ref.pair_order(v)
  heads = functools.partial(kern.attention_heads, interpret=True, pair_ordered=fp8,
                            config=kern.TuningConfig(prefix_block_q=16))
  for extra in ((table,), (table, shared)):
    got = np.asarray(heads(q, k, v, pos, qs, vsc, *extra))
    assert np.all(np.isfinite(got.astype(np.float32))) and not got[11].any()


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float16], ids=["bf16", "fp8", "fp16-codes"])
def test_kernels_lower_for_cuda(kv_dtype):
  S = jax.ShapeDtypeStruct
  f32, i32, bf = jnp.float32, jnp.int32, jnp.bfloat16
  b, t, h, kv, d = 8, 4096, 32, 8, 128
  sc = (S((), f32), S((), f32))
  assert "triton" in lower_for_h200(kern.attention_seq, S((b, t, h, d), bf), S((b, t, kv, d), kv_dtype),
                                 S((b, t, kv, d), kv_dtype), S((b, t), i32), *sc)
  assert "triton" in lower_for_h200(kern.attention_heads, S((256, h, d), bf), S((256, 1536, kv, d), kv_dtype),
                                 S((256, 1536, kv, d), kv_dtype), S((256,), i32), *sc)
  pool = S((3000, 128, kv, d), kv_dtype)  # the paged form: pages of one key block, a page table per sequence
  assert "triton" in lower_for_h200(kern.attention_heads, S((256, h, d), bf), pool, pool, S((256,), i32), *sc,
                                 S((256, 12), i32))
  lowered = lower_for_h200(kern.attention_heads, S((256, h, d), bf), pool, pool, S((256,), i32), *sc, S((256, 12), i32),
                        S((256,), i32))  # the shared-prefix form: the prefix pass, then the resuming decode tiles
  assert lowered.count("__gpu$xla.gpu.triton") == 2
  if kv_dtype == jnp.float8_e4m3fn:  # the sampler's pair-ordered FP8 cache: uint16 carriers into the 16-row tile
    pairs = functools.partial(kern.attention_heads, pair_ordered=True)
    assert "triton" in lower_for_h200(pairs, S((256, h, d), bf), pool, pool, S((256,), i32), *sc, S((256, 12), i32),
                                   S((256,), i32))
  assert "triton" in lower_for_h200(kern.attention_seq, S((64, 512, h, d), bf), pool, pool, S((64, 512), i32), *sc,
                                 S((64, 4), i32))
  if kv_dtype != jnp.float8_e4m3fn:  # the backward reads BF16 values or BF16-held codes (kv_codes)
    bwd = functools.partial(kern.attention_seq_bwd, causal_rows=True, kv_codes=kv_dtype == jnp.float16)
    assert "triton" in lower_for_h200(bwd, S((b, t, h, d), bf), S((b, t, kv, d), bf), S((b, t, kv, d), bf),
                                   S((b, t), i32), *sc, S((b, t, h, d), bf), S((b, h, t), f32), S((b, t, h, d), bf))


def test_backend_selection_is_reported_and_pallas_refuses_without_a_gpu(monkeypatch, caplog):
  q, k, v, _, _ = _qkv(0, 1, 8, 2, 1, 128)
  assert attn.resolve_backend("auto", q, k) == "xla"
  assert "attention:auto->xla" in backends.backend_report()
  with pytest.raises(RuntimeError, match="attn_backend='pallas' cannot run here"):
    attn.resolve_backend("pallas", q, k)
  with pytest.raises(ValueError, match="model.attn_backend"):
    attn.resolve_backend("cudnn", q, k)
  # On a GPU, operands the kernels do not take fall back to the reference, logged and reported.
  monkeypatch.setattr(attn, "_gpu_available", lambda: True)
  q96 = jnp.zeros((1, 8, 2, 96), jnp.bfloat16)
  with caplog.at_level(logging.WARNING):
    assert attn.resolve_backend("auto", q96, q96[:, :, :1]) == "xla"
  assert "head_dim 96" in backends.backend_report()["attention:auto->xla"]
  assert any("head_dim 96" in r.message for r in caplog.records)
  with pytest.raises(RuntimeError, match="head_dim 96"):
    attn.resolve_backend("pallas", q96, q96[:, :, :1])


ATTEND_MESH_SCRIPT = r"""
import functools
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fp8jax import attention as attn
from pallas_kernels import attention as ref, attention_triton as kern
import test_attention as t

class Interpret:  # the Triton kernels in interpret mode stand in for the GPU ones
  TuningConfig, prefix_rows = kern.TuningConfig, kern.prefix_rows
  attention_seq = functools.partial(kern.attention_seq, interpret=True)
  attention_heads = functools.partial(kern.attention_heads, interpret=True)
  attention_seq_bwd = functools.partial(kern.attention_seq_bwd, interpret=True)
attn._kernels = lambda: Interpret
attn.resolve_backend = lambda requested, q, k: "pallas"
mesh = Mesh(np.asarray(jax.devices()).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
b, t_, h, kv, d = 4, 150, 8, 4, 64
q, k, v, ks, vs = t._qkv(3, b, t_, h, kv, d, fp8=True)
ck, cv = t._cache_with_stale_rows(k, v, 256, 0)
pk, pv, table = t._shuffled_pages(ck, cv, ref.BLOCK_KV, 0)
ps = jnp.asarray([3, 140, 77, 128], jnp.int32)
qd = q[jnp.arange(b), ps][:, None]
def go(mesh, *a, pt=None):
  return np.asarray(jax.jit(lambda q, k, v, p: attn.attend(q, k, v, p, k_scale=ks, v_scale=vs, mesh=mesh,
                                                          page_table=pt))(*a), np.float32)
out = dict(dense=bool((go(None, qd, ck, cv, ps[:, None]) == go(mesh, qd, ck, cv, ps[:, None])).all()),
           paged=bool((go(None, qd, pk, pv, ps[:, None], pt=table) == go(mesh, qd, pk, pv, ps[:, None], pt=table)).all()),
           paged_vs_dense=bool((go(mesh, qd, pk, pv, ps[:, None], pt=table) == go(None, qd, ck, cv, ps[:, None])).all()),
           shard_map="shard_map" in str(jax.make_jaxpr(lambda q, k, v, p: attn.attend(
               q, k, v, p, k_scale=ks, v_scale=vs, mesh=mesh, page_table=table))(qd, pk, pv, ps[:, None])))
report(out)
"""


def test_attend_runs_per_device_on_a_mesh_dense_and_paged():
  """On 4 fake devices (sequences over data x heads over tensor), the kernels run under shard_map, each device on its
  sequences and heads; a paged cache's pool is split by heads only (every device holds every page) and its page
  table by sequences. Decode rows bitwise the one-device rows, dense and paged (interpret-mode kernels)."""
  out = child_process.run(ATTEND_MESH_SCRIPT, devices=4, timeout=600)
  assert out == {"dense": True, "paged": True, "paged_vs_dense": True, "shard_map": True}, out


def test_bad_operands_name_the_shapes():
  q, k, v, _, _ = _qkv(0, 2, 8, 4, 2, 64)
  with pytest.raises(ValueError, match="not a multiple"):
    attn.attend(q[:, :, :3], k, v, backend="xla")
  with pytest.raises(ValueError, match="as many keys as queries"):
    attn.attend(q, jnp.concatenate([k, k], 1), jnp.concatenate([v, v], 1), backend="xla")
  with pytest.raises(ValueError, match="q_pos must be"):
    attn.attend(q, k, v, jnp.zeros((2, 3), jnp.int32), backend="xla")
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    attn.attend(q, k.astype(jnp.float32), v, jnp.zeros((2, 8), jnp.int32), backend="xla")


# ------------------------------------------------------------------------------------------------------------------
# GPU: the compiled kernels
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("b,t,h,kv,fp8", [(2, 1000, 32, 8, False), (1, 2048, 16, 4, True), (4, 77, 8, 8, False)])
def test_gpu_kernels_match_reference(b, t, h, kv, fp8):
  d = 128
  q, k, v, ks, vs = _qkv(t, b, t, h, kv, d, fp8=fp8)
  qs, vsc = _scales(d, ks, vs)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  out, lse = kern.attention_seq(q, k, v, pos, qs, vsc)
  want, want_lse = ref.attention_reference(q, k, v, pos, qs, vsc)
  assert _rel(out, want) <= 5e-3
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-4, atol=1e-4)
  ck, cv = _cache_with_stale_rows(k, v, kvcache.padded_len(t + 100), 5)
  ps = jnp.asarray(np.random.default_rng(t).integers(0, t, b), jnp.int32)
  dec = kern.attention_heads(q[jnp.arange(b), ps], ck, cv, ps, qs, vsc)
  assert _rel(dec, want[jnp.arange(b), ps]) <= 5e-3


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("form", ["bf16", "fp8", "fp8-pairs"])
def test_gpu_decode_rows_equal_training_rows_bitwise(form):
  """The one-engine property on the GPU: decode (heads tiles over the cache) == training (sequence tiles). BF16
  and pair-ordered FP8 caches run the 16-row decode tile, natural-order FP8 the 64-row one."""
  fp8, po = form != "bf16", form == "fp8-pairs"
  rng = np.random.default_rng(1 + fp8 + po)
  for trial in range(3):
    b, t = int(rng.integers(1, 9)), int(rng.integers(100, 1500))
    h, kv, d = 32, 8, 128
    q, k, v, ks, vs = _qkv(trial, b, t, h, kv, d, fp8=fp8)
    train = fp8jax.jit(lambda q, k, v: attn.attend(q, k, v, k_scale=ks, v_scale=vs, backend="pallas"))(
        q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    ck, cv = _cache_with_stale_rows(k, v, kvcache.padded_len(t + 300), trial)
    if po:
      ck, cv = ref.pair_order(ck), ref.pair_order(cv)
    step = fp8jax.jit(lambda q, k, v, p: attn.attend(q, k, v, p, k_scale=ks, v_scale=vs, backend="pallas",
                                                     pair_ordered=po))
    ps = jnp.asarray(rng.integers(0, t, b), jnp.int32)
    rows = step(q[jnp.arange(b), ps][:, None], ck, cv, ps[:, None])
    np.testing.assert_array_equal(np.asarray(rows[:, 0]), np.asarray(train[jnp.arange(b), ps]))
    n = int(rng.integers(1, t))
    pre = step(q[:, :n], ck, cv, jnp.broadcast_to(jnp.arange(n), (b, n)))
    np.testing.assert_array_equal(np.asarray(pre), np.asarray(train[:, :n]))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("form", ["bf16", "fp8", "fp8-pairs"])
def test_gpu_paged_rows_equal_training_rows_bitwise(form):
  """The sampler's paged cache on the GPU: decode and prefill through a shuffled page table == training rows."""
  fp8, po = form != "bf16", form == "fp8-pairs"
  b, t, h, kv, d = 5, 1000, 32, 8, 128
  q, k, v, ks, vs = _qkv(21 + fp8, b, t, h, kv, d, fp8=fp8)
  train = fp8jax.jit(lambda q, k, v: attn.attend(q, k, v, k_scale=ks, v_scale=vs, backend="pallas"))(
      q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  ck, cv = _cache_with_stale_rows(k, v, kvcache.padded_len(t + 200), 2)
  pk, pv, table = _shuffled_pages(ck, cv, ref.BLOCK_KV, 2)
  if po:
    pk, pv = ref.pair_order(pk), ref.pair_order(pv)
  step = fp8jax.jit(lambda q, k, v, p, pt: attn.attend(q, k, v, p, k_scale=ks, v_scale=vs, backend="pallas",
                                                       page_table=pt, pair_ordered=po))
  ps = jnp.asarray(np.random.default_rng(3).integers(0, t, b), jnp.int32)
  rows = step(q[jnp.arange(b), ps][:, None], pk, pv, ps[:, None], table)
  np.testing.assert_array_equal(np.asarray(rows[:, 0]), np.asarray(train[jnp.arange(b), ps]))
  pre = step(q[:, :300], pk, pv, jnp.broadcast_to(jnp.arange(300), (b, 300)), table)
  np.testing.assert_array_equal(np.asarray(pre), np.asarray(train[:, :300]))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("form", ["bf16", "fp8", "fp8-pairs"])
def test_gpu_shared_prefix_decode_equals_plain_decode_bitwise(form):
  """The sampler's shared-prefix decode on the GPU (a prompt's pages once per group of samples, Llama's 32/8 heads:
  16 samples per prefix tile) == the plain decode tiles, bit for bit, through ``attend`` as the model calls it."""
  fp8, po = form != "bf16", form == "fp8-pairs"
  groups = [(20, 4), (16, 2), (1, 3), (5, 0), (3, 1)]
  q, k, v, table, pos, shared, _ = _prompt_groups(40 + fp8, groups, 3, 32, 8, 128, fp8)
  ks, vs = (jnp.float32(8 / 448), jnp.float32(4 / 448)) if fp8 else (None, None)
  perm = np.random.default_rng(1).permutation(q.shape[0])
  q, table, pos, shared = q[perm], table[perm], pos[perm], shared[perm]
  ck, cv = (ref.pair_order(k), ref.pair_order(v)) if po else (k, v)
  step = fp8jax.jit(lambda q, p, pt, sb: attn.attend(q[:, None], ck, cv, p[:, None], k_scale=ks, v_scale=vs,
                                                     backend="pallas", page_table=pt, shared_blocks=sb,
                                                     pair_ordered=po)[:, 0])
  got = step(q, pos, table, shared)
  plain = step(q, pos, table, None)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
  qs, vsc = _scales(128, ks, vs)
  want = ref.attention_reference(q[:, None], k, v, pos[:, None], qs, vsc, block_kv=ref.BLOCK_KV,
                                 page_table_BxNb=table, kv_codes=fp8)[0][:, 0]
  assert _rel(got, want) <= 5e-3


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("form", ["bf16", "fp8", "fp8-pairs"])
def test_gpu_decode_rows_equal_training_rows_at_every_position(form):
  """Every position of 4 sequences decoded as its own slot (4,000 slots whose page-table rows point at their
  sequence's pages), plain and through the shared-prefix pass (slots past 128 / 256 keys share 1 / 2 prompt pages),
  == the training rows, bit for bit: ~16M output elements, enough to catch the rare rounding differences (~1e-5 of
  the elements) that a layout-dependent reduction in one tile shape leaves, which the small checks above can miss."""
  fp8, po = form != "bf16", form == "fp8-pairs"
  b, t, h, kv, d = 4, 1000, 32, 8, 128
  q, k, v, ks, vs = _qkv(77 + fp8 + po, b, t, h, kv, d, fp8=fp8)
  train = fp8jax.jit(lambda q, k, v: attn.attend(q, k, v, k_scale=ks, v_scale=vs, backend="pallas"))(
      q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  ck, cv = _cache_with_stale_rows(k, v, kvcache.padded_len(t), 4)
  pk, pv, table = _shuffled_pages(ck, cv, ref.BLOCK_KV, 5)
  if po:
    pk, pv = ref.pair_order(pk), ref.pair_order(pv)
  seq = jnp.repeat(jnp.arange(b), t)
  ps = jnp.tile(jnp.arange(t, dtype=jnp.int32), b)
  shared = jnp.minimum(ps // ref.BLOCK_KV, 2)
  step = fp8jax.jit(lambda q, p, pt, sb: attn.attend(q[:, None], pk, pv, p[:, None], k_scale=ks, v_scale=vs,
                                                     backend="pallas", page_table=pt, shared_blocks=sb,
                                                     pair_ordered=po)[:, 0])
  want = np.asarray(train[seq, ps])
  np.testing.assert_array_equal(np.asarray(step(q[seq, ps], ps, table[seq], None)), want)
  np.testing.assert_array_equal(np.asarray(step(q[seq, ps], ps, table[seq], shared)), want)


@pytest.mark.gpu
@requires_gpu
def test_gpu_gradients_match_reference():
  b, t, h, kv, d = 2, 1100, 16, 4, 128
  q, k, v, _, _ = _qkv(5, b, t, h, kv, d)
  do = jax.random.normal(jax.random.key(6), q.shape, jnp.float32).astype(jnp.bfloat16)
  ks, vs = jnp.float32(0.5), jnp.float32(2.0)

  def grads(backend):
    f = lambda q, k, v: attn.attend(q, k, v, k_scale=ks, v_scale=vs, backend=backend)  # noqa: E731
    _, vjp = jax.vjp(f, q, k, v)
    return vjp(do)

  for name, g_, w in zip(("dq", "dk", "dv"), jax.jit(lambda: grads("pallas"))(), jax.jit(lambda: grads("xla"))()):
    assert _rel(g_, w) <= 2e-2, (name, _rel(g_, w))
