"""Block-scaled FP8 GEMM ``C = A . B^T`` and its plain-jnp reference.

Operands (K is the contraction axis; both operands are K-major, as Hopper FP8 wgmma needs):
  a_q_MxK  E4M3, a_s_MxKb   FP32 — one scale per 1x128 group of A's rows (activations).
  b_q_NxK  E4M3, b_s        FP32 — either (Nb, Kb): one scale per 128x128 tile (weights; fwd/dgrad GEMMs),
                                   or (N, Kb): one scale per 1x128 group (the wgrad GEMM, both operands per-token).
Math (the numerics contract): for each 128-wide K block kb, in increasing kb order,
  C[m, n] += dot(a_q[m, kb], b_q[n, kb]) * (a_s[m, kb] * b_s[n', kb])
with the block dot accumulated in FP32 and never split over K. Each output row therefore depends only on its own
row of A: the result is batch invariant.

BF16 mode (no quantization): ``C = A . B^T`` of BF16 operands with FP32 accumulation, B stored (N, K) likewise;
``core.invariant_dot`` is the XLA path, ``bf16_gemm_reference`` the reference the kernel is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.core import BLOCK, invariant_dot, num_blocks


def expand_b_scale(b_s: jax.Array, n: int) -> jax.Array:
  """(Nb, Kb) tile scales or (N, Kb) row scales -> (N, Kb) row scales."""
  if b_s.shape[0] == n:
    return b_s
  if b_s.shape[0] == num_blocks(n):
    return jnp.repeat(b_s, BLOCK, axis=0)[:n]
  raise ValueError(f"B scale shape {tuple(b_s.shape)} fits neither (N, Kb) nor (ceil(N/128), Kb) for N={n}")


def check_operands(a_q, a_s, b_q, b_s):
  """Shape/dtype checks shared by the reference and the kernels; raises with the offending shapes."""
  if a_q.ndim != 2 or b_q.ndim != 2:
    raise ValueError(f"fp8 gemm takes 2-D operands, got A {a_q.shape} and B {b_q.shape}")
  (m, k), (n, k2) = a_q.shape, b_q.shape
  if k != k2:
    raise ValueError(f"contraction dims differ: A {a_q.shape} vs B {b_q.shape} (B is stored (N, K))")
  if k % BLOCK:
    raise ValueError(f"K = {k} must be a multiple of {BLOCK} (A {a_q.shape}); zero-pad with fp8jax.quant.pad_k")
  if a_s.shape != (m, k // BLOCK):
    raise ValueError(f"A scale must be (M, K/128) = {(m, k // BLOCK)}, got {tuple(a_s.shape)}")
  if b_s.ndim != 2 or b_s.shape[1] != k // BLOCK or b_s.shape[0] not in (n, num_blocks(n)):
    raise ValueError(f"B scale must be (N, K/128) or (ceil(N/128), K/128) for B {b_q.shape}, got {b_s.shape}")
  for name, t in (("A", a_q), ("B", b_q)):
    if t.dtype != jnp.float8_e4m3fn:
      raise ValueError(f"{name} must be float8_e4m3fn, got {t.dtype}")


def bf16_gemm_reference(a_MxK, b_NxK, out_dtype=jnp.float32):
  """BF16 GEMM reference: ``a . b^T`` with FP32 products and sums, cast to ``out_dtype``.

  The BF16 operands are upcast before the dot: a BF16 x BF16 product is exact in FP32, and the dot is then an FP32
  one on every backend (on a GPU a BF16 dot would run on the same tensor cores as the kernel under test).
  """
  if a_MxK.ndim != 2 or b_NxK.ndim != 2 or a_MxK.shape[1] != b_NxK.shape[1]:
    raise ValueError(f"bf16 gemm takes A (M, K) and B stored (N, K), got A {a_MxK.shape} and B {b_NxK.shape}")
  for name, t in (("A", a_MxK), ("B", b_NxK)):
    if t.dtype != jnp.bfloat16:
      raise ValueError(f"bf16 gemm: {name} must be bfloat16, got {t.dtype} (shape {t.shape})")
  return invariant_dot(a_MxK.astype(jnp.float32), b_NxK.astype(jnp.float32)).astype(out_dtype)


def fp8_gemm_reference(a_q_MxK, a_s_MxKb, b_q_NxK, b_s, out_dtype=jnp.bfloat16):
  """Exact block math in plain XLA: per-K-block FP32 dots of the upcast E4M3 values, scaled, summed in order."""
  check_operands(a_q_MxK, a_s_MxKb, b_q_NxK, b_s)
  (m, k), n = a_q_MxK.shape, b_q_NxK.shape[0]
  kb = k // BLOCK
  a_KbxMx128 = a_q_MxK.astype(jnp.float32).reshape(m, kb, BLOCK).transpose(1, 0, 2)
  b_KbxNx128 = b_q_NxK.astype(jnp.float32).reshape(n, kb, BLOCK).transpose(1, 0, 2)
  bs_KbxN = expand_b_scale(b_s, n).astype(jnp.float32).T
  as_KbxM = a_s_MxKb.astype(jnp.float32).T

  def block(acc_MxN, xs):
    a, b, sa, sb = xs
    part = invariant_dot(a, b)
    return acc_MxN + part * (sa[:, None] * sb[None, :]), None

  acc, _ = jax.lax.scan(block, jnp.zeros((m, n), jnp.float32), (a_KbxMx128, b_KbxNx128, as_KbxM, bs_KbxN))
  return acc.astype(out_dtype)
