"""Benchmark of the block-scaled FP8 GEMM (issue 3) on an sm_90 GPU.

  PYTHONPATH=. python3 scripts/bench_gemm.py [--ms 8192,256,64] [--shapes qkv,o,...] [--out DIR] [--no-wgrad]
  PYTHONPATH=. python3 scripts/bench_gemm.py --variants [--ms ...] [--shapes ...]   # schedule variants, bitwise-checked
  PYTHONPATH=. python3 scripts/bench_gemm.py --quant --ms 8192   # activation quantization vs the layer's GEMMs
  PYTHONPATH=. python3 scripts/bench_gemm.py --bf16 [--out DIR]    # BF16 mode vs jnp.dot (cuBLAS): 12 shapes
  PYTHONPATH=. python3 scripts/bench_gemm.py --bf16 --variants     # BF16 schedule variants, bitwise-checked

For M in --ms and the Llama-3.1-8B linear shapes (K x N): TFLOP/s (2*M*N*K / median kernel time) of
  ours     pallas_kernels.fp8_gemm_mgpu.fp8_gemm (1x128 x 128x128 scales, BF16 out; wrapper ops included)
  xla_bf16 XLA BF16 dot (cuBLAS), BF16 operands
  cublas_block  torch scaled_mm with BlockWise1x128 x BlockWise128x128 FP32 scales (cuBLAS)
  cublas_pt     torch._scaled_mm with per-tensor scales
and ratio ours / cublas_block, plus each one's relative error ||out - ref|| / ||ref|| against its exact reference
(the block kernels: pallas_kernels.fp8_gemm.fp8_gemm_reference; per-tensor: the same with unit scales; BF16: the
FP32 dot of the same BF16 operands). JAX times are CUPTI kernel times (jax.experimental.mosaic.gpu.profiler);
torch times are CUDA-event times of a CUDA-graph replay. Each timed call cycles through R distinct operand sets,
so decode-sized B matrices are read from HBM, not L2. Two wgrad rows (1x128 x 1x128, FP32 out) follow.

--bf16 (issue 15): the BF16 mode of the same kernel (``fp8_gemm_mgpu.bf16_gemm``, ``choose_bf16_config``) against
the XLA path fp8jax.ops used for BF16 linears before it (``core.invariant_dot``: a BF16 ``jnp.dot`` with FP32
accumulation, which XLA runs on cuBLAS), at the lm_head (K 4096 x N 128256, FP32 logits; M 64, 256, 8192, 32768)
and the Llama-3.1-8B linears (BF16 out; M 256, 8192). Per row: TFLOP/s of both (CUPTI kernel times), each one's
relative error on sampled rows against ``bf16_gemm_reference`` (an FP32 dot), and row invariance: rows computed at
M = 1 and M = 7 are compared bitwise with the same rows of the M-row product, for ours and for cuBLAS. Exit code 1
if any of ours is not row-invariant or exceeds the error bound of tests/test_fp8_gemm_kernels.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax
import jax.numpy as jnp

from fp8jax import quant
from fp8jax.diagnostics.provenance import provenance
from pallas_kernels import fp8_gemm_mgpu as mgpu
from pallas_kernels.core import invariant_dot
from pallas_kernels.fp8_gemm import bf16_gemm_reference, fp8_gemm_reference

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
LOG = []


def log(*a):
  s = " ".join(str(x) for x in a)
  print(s, flush=True)
  LOG.append(s)


def jax_time_ms(fn, sets, iters=5):
  """Median over iters of (sum of CUPTI kernel times of one call) / len(sets)."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415
  f = jax.jit(lambda ss: [fn(*s) for s in ss])
  try:
    outs, times = profiler.measure(f, iterations=iters)(sets)
    if times:
      return statistics.median(times) / len(sets), outs[0]
  except Exception as e:  # noqa: BLE001
    log("  cupti failed, wall clock:", repr(e)[:200])
  outs = jax.block_until_ready(f(sets))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(sets))
    ts.append((time.perf_counter() - t) * 1e3)
  return statistics.median(ts) / len(sets), outs[0]


def torch_time_ms(calls, iters=5):
  import torch  # noqa: PLC0415
  out = calls[0]()  # the first set's output: the one compared with the reference
  for c in calls[1:]:
    c()
  torch.cuda.synchronize()
  try:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
      for c in calls:
        c()
    run = g.replay
  except Exception as e:  # noqa: BLE001
    log("  cuda graph failed:", repr(e)[:200])
    run = lambda: [c() for c in calls]  # noqa: E731
  run()
  torch.cuda.synchronize()
  ts = []
  for _ in range(iters):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    run()
    e.record()
    torch.cuda.synchronize()
    ts.append(s.elapsed_time(e))
  return statistics.median(ts) / len(calls), out


def to_torch(x):
  import torch  # noqa: PLC0415
  if x.dtype == jnp.float8_e4m3fn:
    return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(torch.float8_e4m3fn)
  return torch.from_dlpack(x)


def to_jax(t):
  return jnp.from_dlpack(t.contiguous())


def rel_err(out, ref):
  out = jnp.asarray(out, jnp.float32)
  return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def make_sets(m, n, k, r, row_scales=False):
  sets = []
  for i in range(r):
    ka, kb = jax.random.split(jax.random.key(1000 * i + m + n + k))
    x = jax.random.normal(ka, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kb, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
    a_q, a_s = quant.quantize_act(x)
    if row_scales:
      b_q, b_s = quant.quantize_act(w)
    else:
      qw = quant.quantize_weight(w)
      b_q, b_s = qw.q, qw.scale
    sets.append(dict(x=x, w=w, a_q=a_q, a_s=a_s, b_q=b_q, b_s=b_s))
  return jax.block_until_ready(sets)


def cublas_block_call(a_q, a_s, b_q, b_s, *, row_scales, out_dtype):
  """A no-argument call of cuBLAS's blockwise FP8 GEMM (torch scaled_mm) on torch views of our operands."""
  import torch  # noqa: PLC0415
  import torch.nn.functional as F  # noqa: PLC0415
  k = a_q.shape[1]
  kb4 = -(-(k // 128) // 4) * 4
  sa = a_s.t().contiguous().t()  # (M, Kb), stride (1, M): outer-dim-major, as cuBLAS wants
  if row_scales:
    sb = b_s.t().contiguous().t()  # (N, Kb), stride (1, N)
    rec_b = F.ScalingType.BlockWise1x128
  else:
    nb = b_s.shape[0]
    sbp = torch.zeros((nb, kb4), dtype=torch.float32, device=b_s.device)
    sbp[:, :b_s.shape[1]] = b_s
    sb = sbp.t()  # (L4, Nb), stride (1, L4)
    rec_b = F.ScalingType.BlockWise128x128
  tdt = torch.bfloat16 if out_dtype == jnp.bfloat16 else torch.float32
  call = lambda: F.scaled_mm(a_q, b_q.t(), sa, F.ScalingType.BlockWise1x128, sb, rec_b,  # noqa: E731
                             output_dtype=tdt)
  try:
    call()
  except Exception as e:  # noqa: BLE001  (older API: torch._scaled_mm with the same scale tensors)
    log("  F.scaled_mm failed, trying torch._scaled_mm:", repr(e)[:300])
    call = lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=tdt)  # noqa: E731
  return call


def bench_case(m, name, k, n, r, row_scales=False, out_dtype=jnp.bfloat16):
  import torch  # noqa: PLC0415
  flops = 2.0 * m * n * k
  tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
  sets = make_sets(m, n, k, r, row_scales)
  s0 = sets[0]
  q = [(s["a_q"], s["a_s"], s["b_q"], s["b_s"]) for s in sets]
  ref = fp8_gemm_reference(*q[0], out_dtype=jnp.float32)
  row = dict(m=m, shape=name, k=k, n=n, variant="wgrad 1x128x1x128" if row_scales else "fwd 1x128x128x128")

  cfg = mgpu.choose_config(m, n, k, row_scales=row_scales)
  row["config"] = str(cfg)
  try:
    ms, out = jax_time_ms(lambda *a: mgpu.fp8_gemm(*a, out_dtype=out_dtype), q)
    row.update(ours=tf(ms), ours_ms=ms, ours_err=rel_err(out, ref))
  except Exception:  # noqa: BLE001
    log("  ours failed:", traceback.format_exc()[-1500:])
  if not row_scales:
    try:
      dn = (((1,), (1,)), ((), ()))
      bf = lambda x, w: jax.lax.dot_general(x, w, dn, preferred_element_type=jnp.bfloat16)  # noqa: E731
      ms, out = jax_time_ms(bf, [(s["x"], s["w"]) for s in sets])
      ref_bf = jax.lax.dot_general(s0["x"].astype(jnp.float32), s0["w"].astype(jnp.float32), dn,
                                   precision=jax.lax.Precision.HIGHEST)
      row.update(xla_bf16=tf(ms), xla_bf16_err=rel_err(out, ref_bf))
    except Exception:  # noqa: BLE001
      log("  xla bf16 failed:", traceback.format_exc()[-1500:])

  # cuBLAS through torch (operands shared with JAX through DLPack).
  tq = [tuple(to_torch(t) for t in s) for s in q]
  try:
    calls = [cublas_block_call(*t, row_scales=row_scales, out_dtype=out_dtype) for t in tq]
    ms, out = torch_time_ms(calls)
    row.update(cublas_block=tf(ms), cublas_block_err=rel_err(to_jax(out), ref))
  except Exception:  # noqa: BLE001
    log("  cublas blockwise failed:", traceback.format_exc()[-2000:])
  if not row_scales:
    try:
      one = torch.ones((), dtype=torch.float32, device="cuda")
      calls = [lambda a_q=a_q, b_q=b_q: torch._scaled_mm(a_q, b_q.t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16) for a_q, _, b_q, _ in tq]
      ms, out = torch_time_ms(calls)
      ones_a = jnp.ones_like(s0["a_s"])
      ones_b = jnp.ones_like(s0["b_s"])
      ref_pt = fp8_gemm_reference(s0["a_q"], ones_a, s0["b_q"], ones_b, out_dtype=jnp.float32)
      row.update(cublas_pt=tf(ms), cublas_pt_err=rel_err(to_jax(out), ref_pt))
    except Exception:  # noqa: BLE001
      log("  cublas per-tensor failed:", traceback.format_exc()[-1500:])
  if "ours" in row and "cublas_block" in row:
    row["ratio"] = row["ours"] / row["cublas_block"]
  del sets, q, tq, ref
  return row


def variant_configs(m, n, k):
  """Schedule variants timed side by side by --variants; the first (choose_config's) is the bitwise reference."""
  T = mgpu.TuningConfig
  first = mgpu.choose_config(m, n, k)
  if m >= 1024:
    # (overlap / direct_store, pingpong and cluster_m, measured on 2026-11-30 and not kept: commits 3fae615,
    # b96e6b7 and af71f35; docs/history.md)
    cands = [T("m", 128, 2, k_blocks=2, cross_tile=True), T("m", 128, 2, k_blocks=2, cross_tile=True, cluster_n=True),
             T("m", 128, 4, num_wgs=3), T("m", 128, 4, cross_tile=True, num_wgs=3),
             T("m", 128, 4, cross_tile=True, num_wgs=3, cluster_n=True)]
  else:
    cands = [T(s, w, st, k_blocks=2, cross_tile=True) for s, w, st in
             (("m", 128, 2), ("n", 64, 4), ("n", 32, 4), ("n", 16, 4))] + [T("n", 16, 8)]
    # Deeper rings for the decode-sized 128-row CTAs (one K block per step, or two without the cross-tile
    # pipeline), and 128 x 64 CTAs (twice the tiles of 128 x 128: N = 6144 fills the SMs).
    cands += [T("m", 128, 5), T("m", 128, 3, k_blocks=2), T("m", 64, 6, k_blocks=2), T("m", 64, 8),
              T("m", 64, 4, k_blocks=2, cross_tile=True)]
  return [first] + [c for c in cands if c != first]


def variants(ms, shapes, out_dir) -> int:
  """Times schedule variants of the Mosaic kernel per shape; checks each bitwise against the first variant."""
  import torch  # noqa: PLC0415
  log("device:", jax.devices()[0].device_kind, "| jax", jax.__version__, "| torch", torch.__version__,
      "| date", time.strftime("%Y-%m-%d %H:%M:%S"))
  lines = ["| M | shape | config | TFLOP/s | vs first | vs cuBLAS blockwise | bitwise = first | err |",
           "|---|---|---|---|---|---|---|---|"]
  bad = 0
  for m in ms:
    for name in shapes:
      k, n = SHAPES[name]
      sets = make_sets(m, n, k, 3 if m >= 1024 else 6)
      q = [(s["a_q"], s["a_s"], s["b_q"], s["b_s"]) for s in sets]
      ref = fp8_gemm_reference(*q[0], out_dtype=jnp.float32)
      calls = [cublas_block_call(*(to_torch(t) for t in s), row_scales=False, out_dtype=jnp.bfloat16) for s in q]
      cub = 2.0 * m * n * k / (torch_time_ms(calls)[0] * 1e-3) / 1e12
      del calls
      lines.append(f"| {m} | {name} | cuBLAS blockwise | {cub:.0f} | | 1.000 | | |")
      log(f"variant M={m} {name} cuBLAS blockwise {cub:.0f} TFLOP/s")
      first = base = None
      for c in variant_configs(m, n, k):
        if n % c.cta_n:
          continue
        log(f"variant M={m} {name} {c} ...")
        try:
          ms_, out = jax_time_ms(lambda *a, c=c: mgpu.fp8_gemm(*a, config=c), q)
        except Exception:  # noqa: BLE001
          log("  failed:", traceback.format_exc()[-1500:])
          continue
        tfl = 2.0 * m * n * k / (ms_ * 1e-3) / 1e12
        out = jax.device_get(out)
        if first is None:
          first, base = out, tfl
        same = bool((out == first).all())
        bad += not same
        err = rel_err(out, ref)
        log(f"  {tfl:.0f} TFLOP/s, x{tfl / base:.3f}, x{tfl / cub:.3f} cuBLAS, bitwise={same}, err={err:.1e}")
        c = mgpu._plan(c, m, n, k, jnp.bfloat16, False, mgpu._num_sms())[0]  # as it ran  # noqa: SLF001
        lines.append(f"| {m} | {name} | {short_config(c)} | {tfl:.0f} | {tfl / base:.3f} | {tfl / cub:.3f} | {same} "
                     f"| {err:.1e} |")
      del sets, q
  return write_variants(lines, bad, out_dir, "bench_gemm_variants.md", "Schedule variants")


def write_variants(lines, bad: int, out_dir, fname: str, title: str) -> int:
  """Writes a variants table to out_dir/fname, prints it last; exit code 1 if any variant differed bitwise."""
  table_s = "\n".join(lines)
  with open(os.path.join(out_dir, fname), "w") as f:
    f.write(table_s + "\n")
  print(f"\n{title} (CUPTI kernel time, median of 5)\n" + table_s)
  return 1 if bad else 0


def _bitwise_equal(x, y) -> bool:
  (q1, s1), (q2, s2) = x, y
  return bool(q1.shape == q2.shape and (q1.view(jnp.uint8) == q2.view(jnp.uint8)).all() and (s1 == s2).all())


def quant_cost(m, out_dir) -> int:
  """Activation-quantization cost vs the GEMMs that consume it, for one Llama-3.1-8B layer forward at M tokens.

  Per layer forward, fp8jax quantizes 4 activations (1x128 groups): the inputs of qkv, o, gate_up (K = 4096) and of
  down (K = 14336); the wgrad path quantizes dy and x transposed (quantize_act_t). Side by side in this run: the
  XLA quantizer (``fp8jax.quant``, fused elementwise + group amax) and the one-pass Pallas kernels
  (``pallas_kernels.fp8_quant``, checked bitwise against it here), with a small sweep of the kernels' block sizes.
  Prints each one's time, its HBM bandwidth (read BF16 + write E4M3 + FP32 scales) and the forward sum as a
  fraction of the layer's four forward GEMMs (our GEMM kernel, same run).
  """
  from pallas_kernels import fp8_quant  # noqa: PLC0415
  lines = ["| op | shape | XLA us | XLA GB/s | kernel us | kernel GB/s | kernel / XLA speed | bitwise |",
           "|---|---|---|---|---|---|---|---|"]
  bad = 0
  x = jax.random.normal(jax.random.key(0), (m, 4096), jnp.bfloat16) * 3
  for name, fn, opts in (("quantize_act", fp8_quant.quantize_act,
                          [dict(block_m=b, num_warps=w) for b in (16, 32, 64) for w in (2, 4, 8)]),
                         ("quantize_act_t", fp8_quant.quantize_act_t,
                          [dict(block_k=b, num_warps=w) for b in (16, 32, 64) for w in (4, 8)])):
    sweep = []
    for o in opts:
      ms_, out = jax_time_ms(lambda a, o=o, fn=fn: fn(a, **o), [(x,)])
      sweep.append(f"{o}: {ms_ * 1e3:.1f} us")
    log(f"  {name} block sweep at {m}x4096:", "; ".join(sweep))
    lines.append(f"| {name} kernel block sweep | {m}x4096 | " + "; ".join(sweep) + " | | | | | |")
  total = {"xla": 0.0, "kernel": 0.0}
  for name, k, count in (("quantize_act", 4096, 3), ("quantize_act", 14336, 1), ("quantize_act_t", 4096, 0),
                         ("quantize_act_t", 14336, 0)):
    xs = [(jax.random.normal(jax.random.key(i + k), (m, k), jnp.bfloat16),) for i in range(3)]
    ref_fn = getattr(quant, name)
    ker_fn = getattr(fp8_quant, name)
    ms_x, out_x = jax_time_ms(ref_fn, xs)
    ms_k, out_k = jax_time_ms(ker_fn, xs)
    same = _bitwise_equal(out_x, out_k)
    bad += not same
    nbytes = m * k * 3 + m * k // 128 * 4
    lines.append(f"| {name} | {m}x{k} | {ms_x * 1e3:.1f} | {nbytes / (ms_x * 1e-3) / 1e9:.0f} | {ms_k * 1e3:.1f} | "
                 f"{nbytes / (ms_k * 1e-3) / 1e9:.0f} | {ms_x / ms_k:.2f}x | {same} |")
    total["xla"] += count * ms_x
    total["kernel"] += count * ms_k
  total_g = 0.0
  for name in ("qkv", "o", "gate_up", "down"):
    k, n = SHAPES[name]
    sets = make_sets(m, n, k, 2)
    ms_, _ = jax_time_ms(lambda *a: mgpu.fp8_gemm(*a), [(s["a_q"], s["a_s"], s["b_q"], s["b_s"]) for s in sets])
    lines.append(f"| fp8_gemm {name} | {m}x{k} . {n}x{k} | - | - | {ms_ * 1e3:.1f} | - | - | - |")
    total_g += ms_
  lines.append(f"| **layer forward: 4 quantizations / 4 GEMMs** | M={m} | {total['xla'] * 1e3:.1f} / "
               f"{total_g * 1e3:.1f} = {total['xla'] / total_g:.1%} | - | {total['kernel'] * 1e3:.1f} / "
               f"{total_g * 1e3:.1f} = {total['kernel'] / total_g:.1%} | - | - | - |")
  table_s = "\n".join(lines)
  with open(os.path.join(out_dir, "bench_quant.md"), "w") as f:
    f.write(table_s + "\n")
  print("\nActivation quantization: XLA vs Pallas kernel, and vs the GEMMs (CUPTI kernel time, median of 5)\n"
        + table_s)
  return 1 if bad else 0


def fmt(x, f="{:.0f}"):
  return "-" if x is None else f.format(x)


def table(rows):
  hdr = ("| M | shape (KxN) | ours | XLA BF16 | cuBLAS block | cuBLAS per-tensor | ours/cuBLAS-block "
         "| err ours | err cuBLAS block | err cuBLAS pt | err BF16 |")
  lines = [hdr, "|" + "---|" * 11]
  for r in rows:
    lines.append("| {} | {} {}x{}{} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
        r["m"], r["shape"], r["k"], r["n"], " (wgrad, FP32 out)" if r["variant"].startswith("wgrad") else "",
        fmt(r.get("ours")), fmt(r.get("xla_bf16")), fmt(r.get("cublas_block")),
        fmt(r.get("cublas_pt")), fmt(r.get("ratio"), "{:.2f}x"), fmt(r.get("ours_err"), "{:.1e}"),
        fmt(r.get("cublas_block_err"), "{:.1e}"), fmt(r.get("cublas_pt_err"), "{:.1e}"),
        fmt(r.get("xla_bf16_err"), "{:.1e}")))
  return "\n".join(lines)


def smoke() -> int:
  """Quick correctness check of the Mosaic kernel on a few shapes/configs (run before timing; exit code 1 if bad)."""
  ok = True
  for m, name, row_scales, cfg in ((1, "qkv", False, None), (8192, "qkv", False, None), (256, "o", False, None),
                                   (130, "o", True, None), (512, "o", False, mgpu.TuningConfig("n", 16)),
                                   (512, "o", False, mgpu.TuningConfig("m", 128))):
    k, n = SHAPES[name]
    try:
      s = make_sets(m, n, k, 1, row_scales)[0]
      q = (s["a_q"], s["a_s"], s["b_q"], s["b_s"])
      out = mgpu.fp8_gemm(*q, out_dtype=jnp.float32, config=cfg)
      err = rel_err(out, fp8_gemm_reference(*q, out_dtype=jnp.float32))
      part = mgpu.fp8_gemm(*(x[m // 2:] for x in q[:2]), *q[2:], out_dtype=jnp.float32)
      same = bool(jnp.all(part == out[m // 2:]))
      log(f"smoke M={m} {name} row_scales={row_scales} {cfg}: err={err:.2e} rows_invariant={same}")
      ok &= err < 1e-3 and same
    except Exception:  # noqa: BLE001
      log(f"smoke M={m} {name} FAILED:", traceback.format_exc()[-2500:])
      return 1
  return 0 if ok else 1


BF16_CASES = ([(m, "lm_head") for m in (64, 256, 8192, 32768)]
              + [(m, name) for m in (256, 8192) for name in ("qkv", "o", "gate_up", "down")])


def bf16_out_dtype(name: str):
  """As fp8jax.ops.linear calls it: FP32 logits from the lm_head, BF16 activations from the linears."""
  return jnp.float32 if name == "lm_head" else jnp.bfloat16


def bf16_bound(k: int, out_dtype) -> float:
  """tests/test_fp8_gemm_kernels.py's bounds: (K/16) * 2^-23 for FP32 outputs, 5e-3 for BF16 ones."""
  return k / 16 * 2.0**-23 if out_dtype == jnp.float32 else 5e-3


def bf16_sets(m, n, k, r):
  """r distinct (A (M, K), B (N, K)) BF16 operand sets (B at the 0.02 scale of initialized weights)."""
  sets = []
  for i in range(r):
    ka, kb = jax.random.split(jax.random.key(2000 * i + m + n + k))
    sets.append((jax.random.normal(ka, (m, k), jnp.bfloat16),
                 (jax.random.normal(kb, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)))
  return jax.block_until_ready(sets)


def sample_rows(m: int, count: int = 256):
  """Up to ``count`` row indices spread over [0, M) (the FP32 reference costs K*N FLOPs per row)."""
  return jnp.unique(jnp.linspace(0, m - 1, min(m, count)).astype(jnp.int32))


def rows_invariant(fn, a, b, full) -> bool:
  """Rows computed at M = 1 and M = 7 (at two places in A) bitwise equal to the same rows of ``full = fn(a, b)``."""
  m = a.shape[0]
  ok = True
  for lo, size in ((0, 1), (m // 2, 1), (max(0, m - 7), 7), (m // 3, 7)):
    size = min(size, m - lo)
    ok &= bool(jnp.all(fn(a[lo:lo + size], b) == full[lo:lo + size]))
  return ok


def bf16_case(m, name):
  k, n = SHAPES[name]
  od = bf16_out_dtype(name)
  flops = 2.0 * m * n * k
  tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
  # Distinct operand sets per timed call keep decode-sized B in HBM (not L2); one set where the outputs are large.
  r = 1 if m * n >= 2**30 else (2 if m >= 1024 else 4)
  sets = bf16_sets(m, n, k, r)
  a, b = sets[0]
  rows = sample_rows(m)
  ref = bf16_gemm_reference(a[rows], b)
  cfg = mgpu._plan(mgpu.choose_bf16_config(m, n, k, out_dtype=od), m, n, k, od, False, mgpu._num_sms(),  # noqa: SLF001
                   jnp.bfloat16)[0]
  row = dict(m=m, shape=name, k=k, n=n, out_dtype=jnp.dtype(od).name, config=short_config(cfg),
             bound=bf16_bound(k, od))
  # Both jitted once per (shapes, out dtype), so the M = 1 / 7 row checks compile once per shape, not per case.
  ours = functools.partial(mgpu.bf16_gemm, out_dtype=od)
  xla = functools.partial(_xla_bf16_dot, out_dtype=od)
  for key, fn in (("ours", ours), ("cublas", xla)):
    try:
      ms, out = jax_time_ms(fn, sets)
      row.update({key: tf(ms), f"{key}_ms": ms, f"{key}_err": rel_err(out[rows], ref),
                  f"{key}_rows_invariant": rows_invariant(fn, a, b, out)})
      del out
    except Exception:  # noqa: BLE001
      log(f"  {key} failed:", traceback.format_exc()[-2000:])
  if "ours" in row and "cublas" in row:
    row["ratio"] = row["ours"] / row["cublas"]
  row["ok"] = bool(row.get("ours_rows_invariant")) and row.get("ours_err", 1.0) <= row["bound"]
  del sets, a, b, ref
  return row


@functools.partial(jax.jit, static_argnames="out_dtype")
def _xla_bf16_dot(a, b, out_dtype):
  return invariant_dot(a, b).astype(out_dtype)


def short_config(c) -> str:
  """A planned TuningConfig in a table cell."""
  flags = [f for f in ("cross_tile", "cluster_n") if getattr(c, f)]
  return (f"{c.split}/{c.wg_n} st{c.max_concurrent_steps} kb{c.k_blocks} wg{c.num_wgs}"
          f" {' '.join(flags)} {c.grid_minor_dim}{c.grid_tile_width}")


def bf16_table(rows):
  lines = ["| M | shape (KxN), out | ours | cuBLAS (jnp.dot) | ours / cuBLAS | err ours | err cuBLAS | bound "
           "| rows invariant: ours | cuBLAS | config |", "|" + "---|" * 11]
  for r in rows:
    lines.append("| {} | {} {}x{}, {} | {} | {} | {} | {} | {} | {:.1e} | {} | {} | {} |".format(
        r["m"], r["shape"], r["k"], r["n"], r["out_dtype"], fmt(r.get("ours")), fmt(r.get("cublas")),
        fmt(r.get("ratio"), "{:.2f}x"), fmt(r.get("ours_err"), "{:.1e}"), fmt(r.get("cublas_err"), "{:.1e}"),
        r["bound"], r.get("ours_rows_invariant", "-"), r.get("cublas_rows_invariant", "-"), r["config"]))
  return "\n".join(lines)


def bf16_main(out_dir) -> int:
  """--bf16: the table of BF16_CASES (module docstring); JSON + log into out_dir."""
  log("device:", jax.devices()[0].device_kind, "| jax", jax.__version__, "| date", time.strftime("%Y-%m-%d %H:%M:%S"))
  rows = []
  for m, name in BF16_CASES:
    t = time.time()
    rows.append(bf16_case(m, name))
    log(json.dumps(rows[-1]), f"({time.time() - t:.1f}s)")
  with open(os.path.join(out_dir, "bench_gemm_bf16.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(out_dir, "bench_gemm_bf16.log"), "w") as f:
    f.write("\n".join(LOG))
  print("\nBF16 GEMM: TFLOP/s (2MNK / median CUPTI kernel time), relative errors vs the FP32 reference on sampled "
        "rows, bitwise row invariance (rows at M = 1 and 7 vs the M-row product)\n" + bf16_table(rows))
  return 0 if all(r["ok"] for r in rows) else 1


def bf16_variant_configs(m, n, k, od):
  """BF16 schedule variants for --bf16 --variants; the first (choose_bf16_config's) is the bitwise reference."""
  T = mgpu.TuningConfig
  first = mgpu.choose_bf16_config(m, n, k, out_dtype=od)
  if m >= 1024:
    cands = [T("m", 128, 4, cross_tile=True), T("m", 128, 4, cross_tile=True, cluster_n=True),
             T("m", 128, 2, k_blocks=2, cross_tile=True, cluster_n=True), T("m", 128, 8, cluster_n=True),
             T("m", 128, 4, cross_tile=True, num_wgs=3, cluster_n=True), T("m", 128, 3, num_wgs=3, cluster_n=True)]
  else:
    cands = [T(s, w, st, k_blocks=kb, cross_tile=True) for s, w in (("m", 128), ("n", 64), ("n", 32), ("n", 16))
             for st, kb in ((8, 1), (4, 2))] + [T("n", 64, 8), T("n", 32, 12)]
    cands += [T("m", 128, st) for st in (4, 5, 6)] + [T("m", 64, st) for st in (6, 8)]
  return [first] + [c for c in cands if c != first]


BF16_VARIANT_CASES = "64:lm_head,8192:lm_head,256:qkv,8192:gate_up,64:o"


def bf16_variants(out_dir, cases: str = BF16_VARIANT_CASES) -> int:
  """--bf16 --variants: BF16 schedule variants per shape, each checked bitwise against choose_bf16_config's.
  ``cases``: comma list of M:shape."""
  log("device:", jax.devices()[0].device_kind, "| jax", jax.__version__, "| date", time.strftime("%Y-%m-%d %H:%M:%S"))
  lines = ["| M | shape, out | config (as run) | TFLOP/s | vs first | bitwise = first |", "|---|---|---|---|---|---|"]
  bad = 0
  for m, name in ((int(c.split(":")[0]), c.split(":")[1]) for c in cases.split(",")):
    k, n = SHAPES[name]
    od = bf16_out_dtype(name)
    sets = bf16_sets(m, n, k, 1 if m * n >= 2**30 else 4)
    first = base = None
    for c in bf16_variant_configs(m, n, k, od):
      if n % c.cta_n:
        continue
      try:
        ms_, out = jax_time_ms(lambda a, b, c=c: mgpu.bf16_gemm(a, b, out_dtype=od, config=c), sets)
      except Exception:  # noqa: BLE001
        log(f"  {m} {name} {c} failed:", traceback.format_exc()[-1500:])
        continue
      tfl = 2.0 * m * n * k / (ms_ * 1e-3) / 1e12
      if first is None:
        first, base = out, tfl
      same = bool(jnp.all(out == first))
      bad += not same
      c = mgpu._plan(c, m, n, k, od, False, mgpu._num_sms(), jnp.bfloat16)[0]  # as it ran  # noqa: SLF001
      lines.append(f"| {m} | {name}, {jnp.dtype(od).name} | {short_config(c)} | {tfl:.0f} | {tfl / base:.3f} "
                   f"| {same} |")
      log(lines[-1])
      del out
    del sets, first
  return write_variants(lines, bad, out_dir, "bench_gemm_bf16_variants.md", "BF16 schedule variants")


def ncu_target(name: str, m: int = 8192) -> int:
  """A short program for Nsight Compute: our kernel and cuBLAS blockwise on one shape, 3 launches each, after a
  warm-up. Profile with scripts/ncu_gemm.sh (it filters the kernels by name)."""
  import torch  # noqa: PLC0415
  k, n = SHAPES[name]
  s = make_sets(m, n, k, 1)[0]
  q = (s["a_q"], s["a_s"], s["b_q"], s["b_s"])
  f = jax.jit(lambda *a: mgpu.fp8_gemm(*a))
  log("ncu target", name, m, "config", mgpu.choose_config(m, n, k))
  for _ in range(3):
    jax.block_until_ready(f(*q))
  call = cublas_block_call(*(to_torch(t) for t in q), row_scales=False, out_dtype=jnp.bfloat16)
  for _ in range(3):
    call()
  torch.cuda.synchronize()
  return 0


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--skip-ours", action="store_true")
  p.add_argument("--ms", default="8192,256,64")
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--no-wgrad", action="store_true")
  p.add_argument("--variants", action="store_true", help="time schedule variants side by side (and check bits)")
  p.add_argument("--quant", action="store_true", help="activation-quantization cost vs the layer's GEMMs")
  p.add_argument("--ncu-target", default=None,
                 help="run one shape's kernels at M = --ms's first value for ncu (scripts/ncu_gemm.sh)")
  p.add_argument("--bf16", action="store_true",
                 help="BF16 mode of our kernel vs jnp.dot (cuBLAS) at the lm_head and 8B linear shapes (--variants: "
                      "BF16 schedule variants); ignores --ms/--shapes")
  p.add_argument("--bf16_cases", default=BF16_VARIANT_CASES, help="--bf16 --variants: comma list of M:shape")
  args = p.parse_args()
  if args.bf16:
    from fp8jax import backends  # noqa: PLC0415
    if not backends.hopper_available():
      print("bench_gemm.py --bf16 needs an sm_90 (Hopper) GPU", file=sys.stderr)
      return 2
    return bf16_variants(args.out, args.bf16_cases) if args.variants else bf16_main(args.out)
  if args.smoke:
    return smoke()
  if args.ncu_target:
    return ncu_target(args.ncu_target, int(args.ms.split(",")[0]))  # M: --ms's first value (default 8192)
  if args.quant:
    return quant_cost(int(args.ms.split(",")[0]), args.out)
  if args.variants:
    return variants([int(x) for x in args.ms.split(",")], args.shapes.split(","), args.out)
  if args.skip_ours:
    mgpu.fp8_gemm = None  # bench_case logs the failure and times the others
  import torch  # noqa: PLC0415
  log("device:", jax.devices()[0].device_kind, "| jax", jax.__version__, "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "| date", time.strftime("%Y-%m-%d %H:%M:%S"))
  rows = []
  for m in [int(x) for x in args.ms.split(",")]:
    for name in args.shapes.split(","):
      k, n = SHAPES[name]
      r = 3 if m >= 1024 else 6
      if name == "lm_head":
        r = 2 if m >= 1024 else 3
      t = time.time()
      row = bench_case(m, name, k, n, r)
      rows.append(row)
      log(json.dumps(row), f"({time.time() - t:.1f}s)")
  if not args.no_wgrad:
    for name, (mm, nn, kk) in {"o": (4096, 4096, 8192), "gate_up": (28672, 4096, 8192)}.items():
      row = bench_case(mm, name + " dW", kk, nn, 2, row_scales=True, out_dtype=jnp.float32)
      rows.append(row)
      log(json.dumps(row))
  meta = {**provenance(packages=("torch",)), "cuda": torch.version.cuda}
  with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
    json.dump(dict(meta, rows=rows), f, indent=1)
  with open(os.path.join(args.out, "bench_gemm.log"), "w") as f:
    f.write("\n".join(LOG))
  print("\nTFLOP/s (2MNK / median kernel time), relative errors vs exact references\n" + table(rows))


if __name__ == "__main__":
  sys.exit(main())
