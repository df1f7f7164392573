"""grouped_linear (the MoE expert GEMM): each group's rows, dx and dw_e bitwise the dense linear on that group alone."""

import fp8jax

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops, quant

from fp8jax import backends
from pallas_kernels import grouped_gemm

# Bitwise equality to the dense op rests on the batch invariance of the XLA:CPU path (see test_ops.cpu_only).
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU/XLA path's bitwise math")

E, N, K, M = 4, 384, 256, 300
# An empty group (in the middle), a one-row group, groups over 128 rows and not multiples of 128, and 29 trailing
# rows past sum(sizes) = 271 that belong to no group.
SIZES = (130, 0, 1, 140)
WRAP = {"bf16": lambda w: w, "fp8_master": quant.FP8Weight, "qweight": quant.quantize_weight}


def rand(key, shape, scale=1.0, dtype=jnp.float32):
  return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


def bits(a):
  return np.asarray(a, np.float32)


def grouped_and_dense(kind, sizes, x, w, dy, cfg=ops.LinearConfig()):
  """(y, dx, dw) of the grouped op, and per group e the same of the dense op on its rows alone (None if empty)."""
  wq = WRAP[kind](w)
  y, vjp = jax.vjp(lambda x, w: ops.grouped_linear(x, w, jnp.asarray(sizes, jnp.int32), cfg), x, wq)
  dx, dw = vjp(dy)
  off = np.concatenate([[0], np.cumsum(sizes)])
  dense = []
  for e in range(len(sizes)):
    rows = slice(off[e], off[e + 1])
    if sizes[e] == 0:
      dense.append(None)
      continue
    ye, vjpe = jax.vjp(lambda x, w: ops.linear(x, w, cfg), x[rows], jax.tree.map(lambda a: a[e], wq))  # noqa: B023
    dense.append((rows, ye, *vjpe(dy[rows])))
  return (y, dx, dw), dense


def dw_array(kind, dw):
  return {"bf16": lambda d: d, "fp8_master": lambda d: d.w, "qweight": lambda d: None}[kind](dw)


@cpu_only
@pytest.mark.parametrize("kind", ["bf16", "fp8_master", "qweight"])
def test_forward_dgrad_wgrad_bitwise_dense_per_group(kind):
  x, w, dy = rand(0, (M, K), 1.0, jnp.bfloat16), rand(1, (E, N, K), 0.05), rand(2, (M, N), 1.0, jnp.bfloat16)
  (y, dx, dw), dense = grouped_and_dense(kind, SIZES, x, w, dy)
  assert y.shape == (M, N) and y.dtype == jnp.bfloat16 and dx.shape == x.shape and dx.dtype == x.dtype
  for e, d in enumerate(dense):
    if d is None:  # the empty group: no rows, and no gradient for its expert
      if kind != "qweight":
        assert not np.any(bits(dw_array(kind, dw)[e]))
      continue
    rows, ye, dxe, dwe = d
    np.testing.assert_array_equal(bits(y[rows]), bits(ye), err_msg=f"forward, group {e}")
    np.testing.assert_array_equal(bits(dx[rows]), bits(dxe), err_msg=f"dgrad, group {e}")
    if kind == "qweight":  # frozen weights: zero cotangent
      assert not any(np.any(bits(a)) for a in jax.tree.leaves(dw))
    else:
      assert dw_array(kind, dw).dtype == w.dtype
      np.testing.assert_array_equal(bits(dw_array(kind, dw)[e]), bits(dw_array(kind, dwe)), err_msg=f"wgrad {e}")
  tail = slice(sum(SIZES), M)
  assert not np.any(bits(y[tail])) and not np.any(bits(dx[tail]))  # rows past the groups: zeros
  assert np.any(bits(y[:1])) and np.any(bits(dx[:1]))


@cpu_only
def test_jit_with_traced_group_sizes():
  """One compilation serves any sizes; a group reaching past row M keeps the rows before M."""
  x, w, dy = rand(3, (M, K), 1.0, jnp.bfloat16), rand(4, (E, N, K), 0.05), rand(5, (M, N), 1.0, jnp.bfloat16)

  @fp8jax.jit
  def step(x, w, sizes, dy):
    y, vjp = jax.vjp(lambda x, w: ops.grouped_linear(x, quant.FP8Weight(w), sizes), x, w)
    return y, *vjp(dy)

  for sizes, clipped in [((0, 300, 0, 0), (0, 300, 0, 0)), ((5, 128, 100, 200), (5, 128, 100, 67))]:
    y, dx, dw = step(x, w, jnp.asarray(sizes, jnp.int32), dy)
    _, dense = grouped_and_dense("fp8_master", clipped, x, w, dy)
    for e, (rows, ye, dxe, dwe) in ((e, d) for e, d in enumerate(dense) if d is not None):
      np.testing.assert_array_equal(bits(y[rows]), bits(ye))
      np.testing.assert_array_equal(bits(dx[rows]), bits(dxe))
      np.testing.assert_array_equal(bits(dw[e]), bits(dwe.w))
  assert step._cache_size() == 1


# As in test_ops: E4M3 with 1x128 / 128x128 scales, relative Frobenius error of a product ~0.03 typical, 0.05 worst.
FP8_VS_BF16_REL_BOUND = 0.06


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_fp8_vs_bf16_within_documented_bound():
  x, w, dy = rand(6, (M, K)), rand(7, (E, N, K), 0.05), rand(8, (M, N))
  f32 = ops.LinearConfig(out_dtype="float32")
  sizes = jnp.asarray(SIZES, jnp.int32)
  y8, vjp8 = jax.vjp(lambda x, w: ops.grouped_linear(x, quant.FP8Weight(w), sizes, f32), x, w)
  yb, vjpb = jax.vjp(lambda x, w: ops.grouped_linear(x, w, sizes, f32), x, w)
  assert rel(y8, yb) < FP8_VS_BF16_REL_BOUND
  (dx8, dw8), (dxb, dwb) = vjp8(dy), vjpb(dy)
  assert rel(dx8, dxb) < FP8_VS_BF16_REL_BOUND
  for e in (0, 3):  # the groups of more than one 128-token block
    assert rel(dw8[e], dwb[e]) < FP8_VS_BF16_REL_BOUND


def test_stacked_weights_quantize_per_expert():
  """quantize_weight / dequantize_weight on (E, N, K): each expert bitwise its own 2-D quantization."""
  w = rand(9, (3, 200, 136), 0.05)
  qw = quant.quantize_weight(w)
  assert qw.q.shape == w.shape and qw.scale.shape == (3, 2, 2)
  for e in range(3):
    qe = quant.quantize_weight(w[e])
    np.testing.assert_array_equal(bits(qw.q[e]), bits(qe.q))
    np.testing.assert_array_equal(qw.scale[e], qe.scale)
    np.testing.assert_array_equal(qw.dequantize()[e], qe.dequantize())


def test_layout_places_groups_on_tile_boundaries():
  dest, tile_expert = grouped_gemm.layout(jnp.asarray(SIZES, jnp.int32), M)
  p = grouped_gemm.padded_rows(M, E)
  assert p == 384 + 4 * 128 and tile_expert.shape == (p // 128,)
  np.testing.assert_array_equal(dest[:130], np.arange(130))  # group 0: tiles 0-1
  assert dest[130] == 256  # group 2 (one row; group 1 is empty): tile 2
  np.testing.assert_array_equal(dest[131:271], 384 + np.arange(140))  # group 3: tiles 3-4
  np.testing.assert_array_equal(dest[271:], p)  # past the groups: dropped
  np.testing.assert_array_equal(tile_expert, [0, 0, 2, 3, 3, 4, 4])


def test_tile_moves_and_their_gradients_are_exact_transposes():
  """to_tiles is the row scatter it replaced (bitwise), from_tiles undoes it, and each one's VJP is the other (the
  gradients gather, never scatter-add): checked against autodiff of the plain scatter / gather."""
  dest, _ = grouped_gemm.layout(jnp.asarray(SIZES, jnp.int32), M)
  p = grouped_gemm.padded_rows(M, E)
  x = rand(21, (M, K), 1.0)
  scatter = lambda x: jnp.zeros((p, K), x.dtype).at[dest].set(x, mode="drop")  # noqa: E731
  gather = lambda y: jnp.take(y, dest, axis=0, mode="fill", fill_value=0)  # noqa: E731
  tiles = grouped_gemm.to_tiles(x, dest, p)
  np.testing.assert_array_equal(tiles, scatter(x))
  np.testing.assert_array_equal(grouped_gemm.from_tiles(tiles, dest)[:sum(SIZES)], x[:sum(SIZES)])
  assert not np.any(np.asarray(grouped_gemm.from_tiles(tiles, dest)[sum(SIZES):]))  # rows past the groups: zeros
  ct_p, ct_m = rand(22, (p, K), 1.0), rand(23, (M, K), 1.0)
  for ours, plain, ct in ((lambda x: grouped_gemm.to_tiles(x, dest, p), scatter, ct_p),
                          (lambda y: grouped_gemm.from_tiles(y, dest), gather, ct_m)):
    arg = x if ct is ct_p else tiles
    np.testing.assert_array_equal(jax.vjp(ours, arg)[1](ct)[0], jax.vjp(plain, arg)[1](ct)[0])


def test_grouped_linear_tiles_is_grouped_linear_without_the_moves():
  """The tile form on rows already in the layout gives grouped_linear's rows and gradients, bitwise; bad shapes
  name themselves."""
  sizes = jnp.asarray(SIZES, jnp.int32)
  dest, tile_expert = grouped_gemm.layout(sizes, M)
  p = grouped_gemm.padded_rows(M, E)
  x, w, dy = rand(24, (M, K), 1.0, jnp.bfloat16), quant.FP8Weight(rand(25, (E, N, K), 0.05)), rand(26, (M, N), 1.0)
  y, vjp = jax.vjp(lambda x, w: ops.grouped_linear(x, w, sizes), x, w)
  tiled = lambda x, w: grouped_gemm.from_tiles(ops.grouped_linear_tiles(  # noqa: E731
      grouped_gemm.to_tiles(x, dest, p), w, tile_expert), dest)
  y_t, vjp_t = jax.vjp(tiled, x, w)
  np.testing.assert_array_equal(bits(y_t), bits(y))
  for a, b in zip(jax.tree.leaves(vjp_t(dy.astype(y.dtype))), jax.tree.leaves(vjp(dy.astype(y.dtype)))):
    np.testing.assert_array_equal(bits(a), bits(b))
  with pytest.raises(ValueError, match=re.escape("x must be (P, K) with P = 128 x tiles = 128 x 7")):
    ops.grouped_linear_tiles(jnp.zeros((M, K)), w, tile_expert)
  with pytest.raises(ValueError, match=re.escape("grouped_linear_tiles: x has K=128 (shape (896, 128)) but weight "
                                                 "is (4, 384, 256)")):
    ops.grouped_linear_tiles(jnp.zeros((p, 128)), w, tile_expert)


@pytest.mark.parametrize("kind", ["bf16", "fp8_master", "qweight"])
def test_no_rows(kind):
  y = ops.grouped_linear(jnp.zeros((0, K)), WRAP[kind](rand(10, (E, N, K), 0.05)), jnp.zeros((E,), jnp.int32))
  assert y.shape == (0, N) and y.dtype == jnp.bfloat16


def test_errors_name_shapes():
  x, w, sizes = jnp.ones((8, K)), rand(11, (E, N, K)), jnp.asarray([2, 2, 2, 2])
  with pytest.raises(ValueError, match=re.escape("x must be 2-D (M, K) rows sorted by group, got shape (2, 4, 256)")):
    ops.grouped_linear(x.reshape(2, 4, K), w, sizes)
  with pytest.raises(ValueError, match=re.escape("weight must be 3-D, stored (E, N, K)") + r".*\(384, 256\)"):
    ops.grouped_linear(x, w[0], sizes)
  with pytest.raises(ValueError, match=re.escape("(E=4 from weight (4, 384, 256)), got shape (3,)")):
    ops.grouped_linear(x, w, sizes[:3])
  with pytest.raises(ValueError, match="group_sizes must be integers"):
    ops.grouped_linear(x, w, sizes.astype(jnp.float32))
  with pytest.raises(ValueError, match=re.escape("x has K=128 (shape (8, 128)) but weight is (4, 384, 256)")):
    ops.grouped_linear(x[:, :128], quant.FP8Weight(w), sizes)
  qw = quant.quantize_weight(w)
  with pytest.raises(ValueError, match=re.escape("QWeight scale must be (E, ceil(N/128), ceil(K/128)) = (4, 3, 2)")):
    ops.grouped_linear(x, quant.QWeight(qw.q, qw.scale[:, :2]), sizes)
  assert ops.grouped_linear(x, w, sizes).shape == (8, N)  # BF16 mode runs no FP8 GEMM


def _interpreted(kernel_fn):
  """(calls, kernel): ``kernel_fn`` in interpret mode, recording the A operand's shape of every call."""
  calls = []

  def kernel(*args, **kw):
    calls.append(args[0].shape)
    return kernel_fn(*args, interpret=True, **kw)
  return calls, kernel


@cpu_only
@pytest.mark.parametrize("kind", ["fp8_master", "qweight"])
def test_grouped_kernel_on_pallas_matches_reference(monkeypatch, kind):
  """The "pallas" backend: forward and dgrad on the grouped Mosaic kernel, the master's wgrad on the grouped wgrad
  kernel (here both in interpret mode), bitwise the reference path. Small integers with power-of-two scales keep
  every sum exact, so the interpreter's summation order cannot show (the GPU bits: tests/test_grouped_kernel.py)."""
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415

  x = rand(12, (M, K), 3.0).round().astype(jnp.bfloat16)
  w = rand(13, (E, N, K), 3.0).round()
  dy = rand(14, (M, N), 3.0).round().astype(jnp.bfloat16)
  sizes = jnp.asarray(SIZES, jnp.int32)
  xla, pallas = ops.LinearConfig(pow2_scales=True, backend="xla"), ops.LinearConfig(pow2_scales=True)
  wq = WRAP[kind](w)
  # jitted: op by op, the interpreted kernel and the quantizers around it ran for 25+ min on 2 cores (CI, 2026-12-02)
  if kind == "fp8_master":  # (x, w) -> (y, dx, dw)
    run = lambda cfg: jax.jit(lambda x, wq, dy: (lambda y, vjp: (y, *vjp(dy)))(
        *jax.vjp(lambda x, wq: ops.grouped_linear(x, wq, sizes, cfg), x, wq)))(x, wq, dy)
  else:  # a frozen QWeight: (y, dx, no dw)
    run = lambda cfg: jax.jit(lambda x, dy: (lambda y, vjp: (y, vjp(dy)[0], None))(
        *jax.vjp(lambda x: ops.grouped_linear(x, wq, sizes, cfg), x)))(x, dy)
  y_ref, dx_ref, dw_ref = run(xla)
  calls, kernel = _interpreted(fp8_gemm_mgpu.grouped_fp8_gemm_tiles)
  wcalls, wkernel = _interpreted(fp8_gemm_mgpu.grouped_fp8_wgrad_tiles)
  monkeypatch.setattr(ops, "resolve_backend", lambda requested: "pallas")
  monkeypatch.setattr(ops, "_pallas_grouped_gemm", lambda: kernel)
  monkeypatch.setattr(ops, "_pallas_grouped_wgrad", lambda: wkernel)
  monkeypatch.setattr(ops, "_pallas_quant", lambda: quant)  # the quantizer itself (the kernels' bits)
  y, dx, dw = run(pallas)
  p = grouped_gemm.padded_rows(M, E)
  assert calls == [(p, K), (p, N)]  # forward, dgrad, on the tile buffer
  # the master's wgrad: dy^T (N padded to 128) on the tile buffer's tokens; a frozen QWeight has none
  assert wcalls == ([(384, p)] if kind == "fp8_master" else [])
  assert np.any(bits(y)) and np.any(bits(dx))
  np.testing.assert_array_equal(bits(y), bits(y_ref))
  np.testing.assert_array_equal(bits(dx), bits(dx_ref))
  if kind == "fp8_master":
    assert np.any(bits(dw.w))
    np.testing.assert_array_equal(bits(dw.w), bits(dw_ref.w))


@cpu_only
def test_bf16_grouped_kernel_on_pallas_matches_reference(monkeypatch):
  """BF16 mode on "pallas": forward and dgrad on the grouped kernel in BF16 mode, dw on the grouped BF16 wgrad kernel
  (both interpret); small integers keep every sum exact, so all three are bitwise the reference path (the GPU bits:
  tests/test_grouped_kernel.py). With random operands the per-tile dw loop (``dot_tiles_wgrad_by_tile``, the
  kernel's reference) is within FP32 rounding of the reference's one dot per group."""
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415

  x = rand(22, (M, K), 3.0).round().astype(jnp.bfloat16)
  w = rand(23, (E, N, K), 3.0).round()  # an FP32 master: dw comes back rounded to BF16, then FP32
  dy = rand(24, (M, N), 3.0).round().astype(jnp.bfloat16)
  sizes = jnp.asarray(SIZES, jnp.int32)
  run = lambda cfg: jax.jit(lambda x, w, dy: (lambda y, vjp: (y, *vjp(dy)))(
      *jax.vjp(lambda x, w: ops.grouped_linear(x, w, sizes, cfg), x, w)))(x, w, dy)
  ref = run(ops.LinearConfig(backend="xla"))
  calls, kernel = _interpreted(fp8_gemm_mgpu.grouped_bf16_gemm_tiles)
  wcalls, wkernel = _interpreted(fp8_gemm_mgpu.grouped_bf16_wgrad_tiles)
  monkeypatch.setattr(ops, "resolve_bf16_backend", lambda requested: "pallas")
  monkeypatch.setattr(ops, "_pallas_grouped_bf16_gemm", lambda: kernel)
  monkeypatch.setattr(ops, "_pallas_grouped_bf16_wgrad", lambda: wkernel)
  got = run(ops.LinearConfig(backend="pallas"))
  p = grouped_gemm.padded_rows(M, E)
  assert calls == [(p, K), (p, N)]  # forward, dgrad, on the tile buffer
  assert wcalls == [(384, p)]  # wgrad: dy^T (N padded to 128) on the tile buffer's tokens
  for name, a, b in zip(("y", "dx", "dw"), got, ref):
    assert np.any(bits(a)), name
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)
  xt, ct = rand(25, (3 * 128, K), 1.0, jnp.bfloat16), rand(26, (3 * 128, N), 1.0)
  tiles = jnp.asarray([1, 1, 3], jnp.int32)
  by_tile = np.asarray(grouped_gemm.dot_tiles_wgrad_by_tile(ct, xt, tiles, E))
  c64, x64 = np.asarray(ct, np.float64), np.asarray(xt, np.float64)
  np.testing.assert_allclose(by_tile[1], c64[:256].T @ x64[:256], rtol=1e-5, atol=1e-4)  # FP64: one dot per group
  np.testing.assert_allclose(by_tile[3], c64[256:].T @ x64[256:], rtol=1e-5, atol=1e-4)
  assert not np.any(by_tile[[0, 2]])


@pytest.mark.gpu
@pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("kind", ["fp8_master", "qweight", "bf16"])
def test_gpu_grouped_kernel_bitwise_dense_per_group(kind):
  """The grouped kernel on the H200 (the "pallas" backend, FP8 and BF16 modes): each group's y and dx bitwise the
  dense ``linear`` (the dense Hopper kernel) on that group's rows alone, at a Qwen3-30B-A3B expert shape (gate/up:
  N 768, K 2048)."""
  sizes = (130, 0, 1, 300, 64, 0, 257, 100)
  m, e, n, k = sum(sizes) + 20, len(sizes), 768, 2048
  x, w, dy = rand(15, (m, k), 1.0, jnp.bfloat16), rand(16, (e, n, k), 0.02), rand(17, (m, n), 1.0, jnp.bfloat16)
  cfg = ops.LinearConfig(backend="pallas")
  (y, dx, _), dense = grouped_and_dense(kind, sizes, x, w, dy, cfg)
  for g, d in enumerate(dense):
    if d is not None:
      rows, ye, dxe, _ = d
      np.testing.assert_array_equal(bits(y[rows]), bits(ye), err_msg=f"forward, group {g}")
      np.testing.assert_array_equal(bits(dx[rows]), bits(dxe), err_msg=f"dgrad, group {g}")
  assert not np.any(bits(y[sum(sizes):])) and not np.any(bits(dx[sum(sizes):]))


@pytest.mark.parametrize("cost", [0, None, 10**6])
@pytest.mark.parametrize("sizes", [[256, 300, 0, 200, 256], [1, 0, 2000, 3, 0]])
def test_sum_by_tile_adds_each_group_in_tile_order(sizes, cost, monkeypatch):
  """``grouped_gemm.sum_by_tile`` (the grouped wgrads' loop) is bitwise a plain loop over the used tiles adding each
  tile's product to its group in tile order, whichever of its two loops runs (``cost`` 0: always per tile; 10**6:
  always by tile position; None: picked from the sizes: balanced -> by position, skewed -> per tile); empty groups
  give exact zeros."""
  if cost is not None:
    monkeypatch.setattr(grouped_gemm, "POSITION_COST", cost)
  sizes = np.asarray(sizes, np.int32)
  _, tile_expert = grouped_gemm.layout(jnp.asarray(sizes), int(sizes.sum()))
  vals = jax.random.normal(jax.random.key(3), (tile_expert.shape[0], 3, 5), jnp.float32) * 1e3
  got = np.asarray(jax.jit(lambda v, te: grouped_gemm.sum_by_tile(lambda t: v[t], te, len(sizes), (3, 5)))(
      vals, tile_expert))
  want = np.zeros((len(sizes), 3, 5), np.float32)
  v = np.asarray(vals)
  for t, e in enumerate(np.asarray(tile_expert)):
    if e < len(sizes):
      want[e] = want[e] + v[t]
  np.testing.assert_array_equal(got, want)
  assert not got[sizes == 0].any()
