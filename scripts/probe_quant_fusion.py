"""Probe of two activation-quantizer fusions that are NOT in fp8jax (tried and reverted, docs/benchmarks.md "The
activation quantizer fused into RMSNorm and SwiGLU"), kept so that its figures can be reproduced on an H200:

* the residual add + RMSNorm kernel also quantizing its rows (1x128 groups), two ways: an in-kernel 3-D view of the
  (rows, D) tile ("reshape") or the tile read 3-D through its BlockSpec ("3d"); per variant: deterministic over 5
  runs, elements more than one BF16 ulp from XLA's formula, batch invariance (64 vs 4096 rows), codes and scales vs
  the quantizer kernel, and CUPTI time at M = 256 vs the plain norm kernel + the quantizer kernel;
* SwiGLU's product + the quantizer in one Pallas Triton kernel over the fused gate/up output, per block height,
  warps and whether the BF16 product is written too, vs XLA's fusion + the quantizer kernel (8B decode: 256 x 14336).

Run: ``PYTHONPATH=. python3 scripts/probe_quant_fusion.py`` (writes $OUT/quant_fusion_probe_h200.json)."""
import functools
import json
import os
import sys

import fp8jax  # noqa: F401  (first: XLA flags)

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp8jax import quant
from pallas_kernels import fp8_quant
from pallas_kernels import rms_norm as rn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import jax_time_ms  # noqa: E402

B, EPS, F32 = quant.BLOCK, 1e-5, jnp.float32


def _rms3(s3, w3, d):
  """``rms_norm.rms_rows`` on a (rows, D / 128, 128) tile: the same math, reduced over the last two axes."""
  x32 = s3.astype(F32)
  amax = jnp.max(jnp.max(jnp.abs(x32), axis=2), axis=1)[:, None, None]
  field = lax.shift_right_logical(lax.bitcast_convert_type(amax, jnp.int32), jnp.int32(23))
  p2 = lax.bitcast_convert_type(lax.shift_left(jnp.maximum(253 - field, 1), jnp.int32(23)), F32)
  sc = jnp.where((amax > rn.SAFE_AMAX) & (amax < jnp.inf), p2, jnp.float32(1.0))
  xs = x32 * sc
  ms = jnp.sum(jnp.sum(xs * xs, axis=2), axis=1)[:, None, None] / d
  y = xs * lax.rsqrt(ms + EPS * (sc * sc))
  return w3.astype(s3.dtype) * y.astype(s3.dtype)


def _norm_kernel(x_ref, h_ref, w_ref, s_ref, o_ref, q_ref, sc_ref, *, d: int, tile_3d: bool):
  s = rn.residual_add(x_ref[...], h_ref[...])
  s_ref[...] = s
  y = _rms3(s, w_ref[...], d) if tile_3d else rn.rms_rows(s, w_ref[...], EPS)
  o_ref[...] = y
  yb = y.astype(F32) if tile_3d else y.astype(F32).reshape(y.shape[0], d // B, B)
  scale = quant._scale_from_amax(quant._finite_amax(yb, -1), False)
  q = quant.to_e4m3(yb * quant.reciprocal(scale)[:, :, None], native_cast=True)
  q_ref[...] = q if tile_3d else q.reshape(y.shape[0], d)
  sc_ref[...] = scale.T


@functools.partial(jax.jit, static_argnames=("variant",))
def norm_quant(x, h, w, variant: str):
  """(s, y, q, scale_t) of the quantizing norm kernel, ``variant`` "reshape" or "3d" (module docstring)."""
  m, d = x.shape
  r, g = rn.rows_per_tile(d), d // B
  tile_3d = variant == "3d"
  if tile_3d:
    shape, args = (m, g, B), (x.reshape(m, g, B), h.reshape(m, g, B), w.reshape(1, g, B))
    spec, wspec = pl.BlockSpec((r, g, B), lambda i: (i, 0, 0)), pl.BlockSpec((1, g, B), lambda i: (0, 0, 0))
  else:
    shape, args = (m, d), (x, h, w.reshape(1, d))
    spec, wspec = pl.BlockSpec((r, d), lambda i: (i, 0)), pl.BlockSpec((1, d), lambda i: (0, 0))
  s, y, q, sc = pl.pallas_call(
      functools.partial(_norm_kernel, d=d, tile_3d=tile_3d), grid=(m // r,), in_specs=[spec, spec, wspec],
      out_specs=[spec, spec, spec, pl.BlockSpec((g, r), lambda i: (0, i))],
      out_shape=[jax.ShapeDtypeStruct(shape, x.dtype)] * 2 + [jax.ShapeDtypeStruct(shape, quant.FP8_DTYPE),
                                                              jax.ShapeDtypeStruct((g, m), F32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), name=f"probe_norm_{variant}")(*args)
  return s.reshape(m, d), y.reshape(m, d), q.reshape(m, d), sc


def _rows(seed, m, d):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal((m, d)) * np.exp(rng.uniform(-7, 7, (m, 1))), F32).astype(jnp.bfloat16)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)


def probe_norm(d: int, res: dict):
  x, h = _rows(d, 4096, d), _rows(d + 1, 4096, d)
  w = jnp.asarray(1 + 0.1 * np.random.default_rng(d + 2).standard_normal(d), F32)
  ref_y = np.asarray(jax.jit(lambda x, h, w: rn.rms_rows(rn.residual_add(x, h), w, EPS))(x, h, w), F32)
  for variant in ("reshape", "3d"):
    key, r = f"{variant}_d{d}", {}
    try:
      outs = [norm_quant(x, h, w, variant) for _ in range(5)]
      r["deterministic"] = all(all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(outs[0], o)) for o in outs[1:])
      _, y, q, sc = outs[0]
      ok = np.isfinite(ref_y)
      off = np.abs(np.asarray(y, F32) - ref_y)[ok] > 2.0**-7 * np.abs(ref_y[ok]) + 1e-30
      r["elements_over_1ulp_vs_xla"] = int(off.sum())
      ref_bits = _bits(jnp.asarray(ref_y).astype(jnp.bfloat16))
      r["rows_bitwise_vs_xla"] = float(np.mean(np.all(_bits(y) == ref_bits, axis=1)))
      r["batch_invariant_64_vs_4096"] = bool(np.array_equal(_bits(norm_quant(x[:64], h[:64], w, variant)[1]),
                                                            _bits(y[:64])))
      qr, scr = fp8_quant.quantize_act(y, scales_t=True)
      r["codes_equal_quantizer"] = bool(np.array_equal(_bits(q), _bits(qr)) and np.array_equal(sc, scr))
      t, _ = jax_time_ms(lambda a, b: norm_quant(a, b, w, variant), [(x[:256], h[:256])] * 4, iters=10)
      r["us_m256"] = t * 1e3
    except Exception as e:  # noqa: BLE001 (a variant that does not build is a result too)
      r["error"] = repr(e)[:400]
    res[key] = r
    print(key, r, flush=True)
  t, _ = jax_time_ms(lambda a, b: fp8_quant.quantize_act(rn.add_rms_norm(a, b, w, EPS)[1], scales_t=True),
                     [(x[:256], h[:256])] * 4, iters=10)
  res[f"plain_d{d}"] = {"us_m256": t * 1e3}
  print(f"plain add_rms_norm + quantize_act d{d}: {t * 1e3:.2f} us", flush=True)


def _swiglu_kernel(g_ref, u_ref, *outs, write_h: bool):
  hh = jax.nn.silu(g_ref[...].astype(F32)).astype(u_ref.dtype) * u_ref[...]
  if write_h:
    outs[0][...] = hh
  q, s = fp8_quant._quantize_rows(hh, False, True)
  outs[-2][...] = q
  outs[-1][...] = s.reshape(outs[-1].shape)


@functools.partial(jax.jit, static_argnames=("bm", "warps", "write_h"))
def swiglu_quant(gu, bm: int, warps: int, write_h: bool):
  m, f = gu.shape[0], gu.shape[1] // 2
  fb = f // B
  spec = pl.BlockSpec((bm, B), lambda i, j: (i, j))
  out_shape = [jax.ShapeDtypeStruct((m, f), quant.FP8_DTYPE), jax.ShapeDtypeStruct((fb, m), F32)]
  out_specs = [spec, pl.BlockSpec((1, bm), lambda i, j: (j, i))]
  if write_h:
    out_shape, out_specs = [jax.ShapeDtypeStruct((m, f), gu.dtype)] + out_shape, [spec] + out_specs
  return pl.pallas_call(functools.partial(_swiglu_kernel, write_h=write_h), grid=(m // bm, fb),
                        in_specs=[spec, pl.BlockSpec((bm, B), lambda i, j: (i, j + fb))], out_specs=out_specs,
                        out_shape=out_shape, compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
                        name="probe_swiglu")(gu, gu)


def _xla_then_quant(gu):
  f = gu.shape[1] // 2
  hh = jax.nn.silu(gu[:, :f].astype(F32)).astype(gu.dtype) * gu[:, f:]
  return fp8_quant.quantize_act(hh, scales_t=True)


def probe_swiglu(res: dict):
  gu = jax.random.normal(jax.random.key(0), (256, 2 * 14336), F32).astype(jnp.bfloat16)
  t, (qx, _) = jax_time_ms(_xla_then_quant, [(gu,)] * 4, iters=10)
  res["swiglu_xla_plus_quant_us"] = t * 1e3
  print(f"swiglu XLA + quantize_act: {t * 1e3:.2f} us", flush=True)
  for bm in (8, 16, 32, 64):
    for warps in (1, 2, 4):
      for write_h in (True, False):
        t, out = jax_time_ms(lambda g: swiglu_quant(g, bm, warps, write_h), [(gu,)] * 4, iters=10)
        same = bool(np.array_equal(_bits(out[-2]), _bits(qx)))
        res[f"swiglu_bm{bm}_w{warps}_h{int(write_h)}"] = {"us": t * 1e3, "codes_equal_xla_path": same}
        print(f"swiglu bm{bm} w{warps} h{int(write_h)}: {t * 1e3:.2f} us codes==xla+quant: {same}", flush=True)


if __name__ == "__main__":
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
  for d in (1024, 4096):
    probe_norm(d, results)
  probe_swiglu(results)
  with open(os.path.join(os.environ.get("OUT", "."), "quant_fusion_probe_h200.json"), "w") as f:
    json.dump(results, f, indent=1)
