"""Exhaustive check of the quantizer's E4M3 rounding (``fp8jax.quant.to_e4m3``) on the default JAX backend.

  PYTHONPATH=. python3 scripts/check_e4m3_exhaustive.py [--chunk-log2 25]

Feeds all 2**32 FP32 bit patterns through the jitted ``to_e4m3`` (each of its forms available on the backend: the
platform default, the exact FP32 rounding, and on GPUs the native cast through XLA and inside a Pallas Triton
kernel) and compares with an independent single-rounding
reference: NumPy clip to +-448, then ml_dtypes' float8_e4m3fn cast (round to nearest even); non-finite inputs must
give NaN. Also checks the power-of-two scale rounding of ``_scale_from_amax`` against frexp/ldexp on 4M amaxes
spanning the FP32 range. Prints the mismatch counts; exit code 1 if any. (The CI test, tests/test_quant.py, checks
every rounding boundary; this is the full sweep, run once per backend and recorded in docs/history.md.)
"""

from __future__ import annotations

import argparse
import sys
import time

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp8jax import quant


def _triton_cast():
  """``to_e4m3(native_cast=True)`` inside a Pallas Triton kernel: the form the activation kernels compile to."""
  from jax.experimental import pallas as pl  # noqa: PLC0415

  def kernel(x_ref, o_ref):
    o_ref[...] = jax.lax.bitcast_convert_type(quant.to_e4m3(x_ref[...], native_cast=True), jnp.uint8)

  def f(x):
    n = x.shape[0]
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.uint8), grid=(n // 4096,),
                          in_specs=[pl.BlockSpec((4096,), lambda i: (i,))],
                          out_specs=pl.BlockSpec((4096,), lambda i: (i,)))(x)
  return jax.jit(f)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--chunk-log2", type=int, default=25)
  args = p.parse_args()
  chunk = 1 << args.chunk_log2
  bits = lambda q: jax.lax.bitcast_convert_type(q, jnp.uint8)  # noqa: E731
  forms = {"to_e4m3 (platform default)": jax.jit(lambda x: bits(quant.to_e4m3(x))),
           "to_e4m3 exact FP32 rounding": jax.jit(lambda x: bits(quant.to_e4m3(x, native_cast=False)))}
  if jax.devices()[0].platform == "gpu":
    forms["to_e4m3 native cast in XLA"] = jax.jit(lambda x: bits(quant.to_e4m3(x, native_cast=True)))
    forms["to_e4m3 native cast in a Pallas Triton kernel"] = _triton_cast()
  bad = dict.fromkeys(forms, 0)
  t = time.time()
  for c in range((1 << 32) // chunk):
    x = np.arange(c * chunk, (c + 1) * chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
      ref = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    finite = np.isfinite(x)
    for name, f in forms.items():
      got = np.asarray(f(x))
      bad[name] += int((~np.where(finite, got == ref, (got & 0x7F) == 0x7F)).sum())
  for name, n in bad.items():
    print(f"{name} on {jax.devices()[0].device_kind}: {n} mismatches over 2**32 FP32 bit patterns")
  print(f"({time.time() - t:.0f} s)")
  rng = np.random.default_rng(0)
  a = np.abs(rng.standard_normal(1 << 22) * 10.0 ** rng.integers(-30, 38, 1 << 22)).astype(np.float32)
  a = np.concatenate([a, np.float32(448) * np.float32(2.0) ** np.arange(-100, 120, dtype=np.float32),
                      np.array([0, 1e-30, 3.4e38], np.float32)]).astype(np.float32)
  s = np.asarray(jax.jit(lambda a: quant._scale_from_amax(a, True))(a))
  sc = np.maximum(a, np.float32(quant.AMAX_FLOOR)) * np.float32(quant.INV_E4M3_MAX)
  m, e = np.frexp(sc)
  ref = np.ldexp(np.float32(1), np.where(m == 0.5, e - 1, e)).astype(np.float32)
  bad_s = int((s != ref).sum())
  print(f"pow2 scales: {bad_s} mismatches of {a.size}")
  return 1 if any(bad.values()) or bad_s else 0


if __name__ == "__main__":
  sys.exit(main())
