"""Benchmark of the grouped (MoE) mode of the FP8 Mosaic GEMM (issue 17) on an sm_90 GPU, at Qwen3-30B-A3B shapes.

  PYTHONPATH=. python3 scripts/bench_grouped.py [--tokens 8192] [--out DIR] [--no-dense-loop] [--no-ragged-dot]

Routed rows = tokens x top-8 over 128 experts, balanced and skewed (Zipf 1.2, E/16 empty experts) routing
(``grouped_gemm.routing_sizes``), for the expert GEMMs C = A . W_e^T: gate / up (N 768, K 2048) and down (N 2048,
K 768; the dgrads are the same two shapes swapped). TFLOP/s = 2 * routed rows * N * K / median time of
  ours        fp8_gemm_mgpu.grouped_fp8_gemm: the whole op (rows -> tile buffer, kernel, tile buffer -> rows)
  ours_kernel fp8_gemm_mgpu.grouped_fp8_gemm_tiles on the tile buffer (the kernel; unused tiles skipped)
  ours_cross  the kernel with a cross-tile pipeline (computes the unused tiles)
  dense_loop  a per-expert loop of our dense fp8_gemm (one launch per non-empty expert, on its rows of the tile
              buffer)
  cublas_loop a per-expert loop of cuBLAS's blockwise FP8 GEMM (torch scaled_mm, BlockWise1x128 x 128x128, as
              bench_gemm's cublas_block) on the same padded rows of the tile buffer, one CUDA graph
  ragged_dot  XLA's jax.lax.ragged_dot, BF16 operands (FP32 accumulation, BF16 out)
  torch_gmm   torch._grouped_mm, BF16 operands (CUDA-event time of a CUDA-graph replay)
JAX times are CUPTI kernel times (bench_gemm.jax_time_ms, wrapper ops included). Checks: ours against
``fp8_gemm_reference`` on 4 groups' rows (relative error), and those rows bitwise the dense kernel's (the invariance
contract); exit code 1 if either fails. Writes bench_grouped.json and .log to --out; the table is printed last.
Expected runtime on an H200: ~2-3 min (mostly compiles: the dense loop compiles one kernel per distinct tile count
of a group). Issue 17 asks for 8192 and 256 tokens: run it twice (``--tokens 256`` for the decode-sized case).

``--wgrad``: the expert weight gradients instead, dW_e = dY_e^T . X_e over each expert's routed rows (the same shapes
and routings; TFLOP/s as above), on the tile buffer:
  fp8           ``ops._grouped_wgrad``: both operands quantized 1x128 over tokens (the Pallas quantizer), then the
                grouped FP8 wgrad kernel (``fp8_gemm_mgpu.grouped_fp8_wgrad_tiles``)
  fp8_kernel    the kernel alone on the quantized operands
  fp8_xla       the reference on the same operands (``grouped_gemm.grouped_wgrad_tiles``: XLA loops over tiles,
                ``sum_by_tile``; what the FP8 wgrad ran before the kernel)
  bf16          the BF16 experts' wgrad on "pallas": dY^T, X^T (XLA transposes) into the grouped BF16 wgrad kernel
  bf16_xla      ``grouped_gemm.dot_tiles_wgrad_by_tile`` (what the BF16 wgrad ran before the kernel)
  torch_gmm     torch._grouped_mm BF16 with the groups along the contraction (dY^T (N, rows) . X (rows, K)), on the
                tile buffer (its groups' rows must be multiples of 8; the zero rows add nothing)
Checks (exit code 1 if one fails): fp8_kernel vs fp8_xla (same operands; relative Frobenius <= 1e-3), bf16 vs
bf16_xla (<= 1e-4: one FP32 chain per group vs per-tile sums), fp8 vs bf16 (FP8 rounding, reported, <= 0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax
import jax.numpy as jnp
import numpy as np

from bench_gemm import LOG, cublas_block_call, fmt, jax_time_ms, log, rel_err, to_torch, torch_time_ms
from fp8jax import quant
from fp8jax.diagnostics.provenance import provenance
from pallas_kernels import fp8_gemm_mgpu as mgpu
from pallas_kernels import grouped_gemm
from pallas_kernels.fp8_gemm import fp8_gemm_reference

E, TOP_K = 128, 8
SHAPES = {"gate_up": (768, 2048), "down": (2048, 768)}  # name: (N, K)
ROUTINGS = {"balanced": 0.0, "skewed": 1.2}
TOL_BF16 = 5e-3  # tests/test_grouped_kernel.py: BF16 out vs the exact block math


def operands(m, n, k, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (E, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
  a_q, a_s = quant.quantize_act(x)
  qw = quant.quantize_weight(w)
  return jax.block_until_ready((x, w, a_q, a_s, qw.q, qw.scale))


def dense_loop(sizes):
  """A per-expert loop of the dense kernel on the tile buffer (static sizes): expert e's padded rows (its rows and
  the zero rows up to the next multiple of 128, which the grouped kernel computes too) -> (P, N) BF16. Padding to
  128 rows also bounds the compiles to one per distinct tile count."""
  padded = -(-sizes // 128) * 128
  off = np.concatenate([[0], np.cumsum(padded)])

  def f(a_q, a_s, b_q, b_s):
    outs = [mgpu.fp8_gemm(a_q[off[e]:off[e + 1]], a_s[off[e]:off[e + 1]], b_q[e], b_s[e], out_dtype=jnp.bfloat16)
            for e in range(E) if sizes[e]]
    return jnp.concatenate(outs)
  return f


def torch_grouped_mm_call(x, w_ExNxK, sizes):
  import torch  # noqa: PLC0415
  a, b = to_torch(x), to_torch(w_ExNxK).transpose(-2, -1)  # (E, K, N), K-major like our B
  offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
  return lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)


def cublas_loop_ms(sizes, aq_t, as_t, b_q, b_s) -> float:
  """ms of one pass of cuBLAS's blockwise FP8 GEMM over every non-empty expert's padded rows of the tile buffer
  (the rows ``dense_loop`` runs), captured in one CUDA graph."""
  padded = -(-sizes // 128) * 128
  off = np.concatenate([[0], np.cumsum(padded)])
  a, sa, b, sb = (to_torch(t) for t in (aq_t, as_t, b_q, b_s))
  calls = [cublas_block_call(a[off[e]:off[e + 1]], sa[off[e]:off[e + 1]], b[e], sb[e], row_scales=False,
                             out_dtype=jnp.bfloat16) for e in range(E) if sizes[e]]
  ms, _ = torch_time_ms([lambda: [c() for c in calls]])
  return ms


def bench_case(name, routing, tokens, args):
  n, k = SHAPES[name]
  sizes = grouped_gemm.routing_sizes(tokens, TOP_K, E, ROUTINGS[routing])
  m = int(sizes.sum())
  tf = lambda ms: 2.0 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
  x, w, a_q, a_s, b_q, b_s = operands(m, n, k)
  sizes_E = jnp.asarray(sizes)
  row = dict(shape=name, n=n, k=k, routing=routing, rows=m, max_group=int(sizes.max()),
             empty_groups=int((sizes == 0).sum()), config=str(mgpu._grouped_config(
                 None, grouped_gemm.padded_rows(m, E), n, k, mgpu._num_sms())))
  ok = True
  try:
    ms, out = jax_time_ms(lambda *o: mgpu.grouped_fp8_gemm(*o, out_dtype=jnp.bfloat16), [(a_q, a_s, b_q, b_s, sizes_E)])
    row.update(ours=tf(ms), ours_ms=ms)
    off = np.concatenate([[0], np.cumsum(sizes)])
    nonempty = [e for e in range(E) if sizes[e]]
    errs, same = [], True
    for e in (nonempty[0], nonempty[len(nonempty) // 2], nonempty[-1], int(np.argmax(sizes))):
      r = slice(off[e], off[e + 1])
      errs.append(rel_err(out[r], fp8_gemm_reference(a_q[r], a_s[r], b_q[e], b_s[e], out_dtype=jnp.float32)))
      same &= bool(jnp.all(out[r] == mgpu.fp8_gemm(a_q[r], a_s[r], b_q[e], b_s[e], out_dtype=jnp.bfloat16)))
    row.update(ours_err=max(errs), dense_bitwise=same)
    ok = max(errs) <= TOL_BF16 and same
  except Exception:  # noqa: BLE001
    log("  ours failed:", traceback.format_exc()[-2500:])
    ok = False
  aq_t, as_t, _, tile_expert = jax.block_until_ready(grouped_gemm.tile_operands(a_q, a_s, sizes_E, E))
  T = mgpu.TuningConfig
  for key, cfg in (("ours_kernel", None), ("ours_cross", T("m", 128, 2, k_blocks=2, cross_tile=True))):
    try:
      ms, _ = jax_time_ms(lambda *o, cfg=cfg: mgpu.grouped_fp8_gemm_tiles(*o, out_dtype=jnp.bfloat16, config=cfg),
                          [(aq_t, as_t, b_q, b_s, tile_expert)])
      row[key] = tf(ms)
    except Exception:  # noqa: BLE001
      log(f"  {key} failed:", traceback.format_exc()[-1500:])
  if not args.no_dense_loop:
    try:
      ms, _ = jax_time_ms(dense_loop(sizes), [(aq_t, as_t, b_q, b_s)], iters=3)
      row["dense_loop"] = tf(ms)
    except Exception:  # noqa: BLE001
      log("  dense loop failed:", traceback.format_exc()[-1500:])
  try:
    row["cublas_loop"] = tf(cublas_loop_ms(sizes, aq_t, as_t, b_q, b_s))
  except Exception:  # noqa: BLE001
    log("  cuBLAS blockwise loop failed:", traceback.format_exc()[-1500:])
  if not args.no_ragged_dot:
    try:
      w_t = jnp.swapaxes(w, 1, 2)  # (E, K, N), as ragged_dot takes it
      rd = lambda x, w_t, s: jax.lax.ragged_dot(x, w_t, s, preferred_element_type=jnp.bfloat16)  # noqa: E731
      t = time.time()
      jax.block_until_ready(jax.jit(rd)(x, w_t, sizes_E))
      if time.time() - t > 20:  # (a dense fallback over all experts would take minutes to time)
        log(f"  ragged_dot: first call took {time.time() - t:.0f} s; not timed")
      else:
        ms, _ = jax_time_ms(rd, [(x, w_t, sizes_E)], iters=3)
        row["ragged_dot"] = tf(ms)
    except Exception:  # noqa: BLE001
      log("  ragged_dot failed:", traceback.format_exc()[-1500:])
  try:
    ms, _ = torch_time_ms([torch_grouped_mm_call(x, w, sizes)])
    row["torch_gmm"] = tf(ms)
  except Exception:  # noqa: BLE001
    log("  torch._grouped_mm failed:", traceback.format_exc()[-1500:])
  if "ours" in row and "torch_gmm" in row:
    row["ours_vs_torch"] = row["ours"] / row["torch_gmm"]
  return row, ok


def bench_wgrad_case(name, routing, tokens):
  from fp8jax import ops  # noqa: PLC0415
  n, k = SHAPES[name]
  sizes = grouped_gemm.routing_sizes(tokens, TOP_K, E, ROUTINGS[routing])
  m = int(sizes.sum())
  tf = lambda ms: 2.0 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
  kx, kd = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  dy = jax.random.normal(kd, (m, n), jnp.bfloat16)
  dest, tile_expert = grouped_gemm.layout(jnp.asarray(sizes), m)
  p = grouped_gemm.padded_rows(m, E)
  x_p, dy_p = jax.block_until_ready((grouped_gemm.to_tiles(x, dest, p), grouped_gemm.to_tiles(dy, dest, p)))
  row = dict(shape=name, n=n, k=k, routing=routing, rows=m, max_group=int(sizes.max()),
             empty_groups=int((sizes == 0).sum()))
  cfg = ops.LinearConfig()
  outs = {}
  aq, as_ = ops.quantize_act_t(dy_p, cfg.pow2_scales)
  bq, bs = ops.quantize_act_t(x_p, cfg.pow2_scales)
  kernel = lambda a, sa, b, sb: mgpu.grouped_fp8_wgrad_tiles(a, sa, b, sb, tile_expert, num_experts=E)  # noqa: E731
  calls = {
      "fp8": (lambda d, xx: ops._grouped_wgrad(d, xx, tile_expert, E, cfg), (dy_p, x_p)),
      "fp8_kernel": (kernel, (aq, as_, bq, bs)),
      "fp8_xla": (lambda a, sa, b, sb: grouped_gemm.grouped_wgrad_tiles(a, sa, b, sb, tile_expert, E),
                  (aq, as_, bq, bs)),
      "bf16": (lambda d, xx: mgpu.grouped_bf16_wgrad_tiles(d.T, xx.T, tile_expert, num_experts=E), (dy_p, x_p)),
      "bf16_xla": (lambda d, xx: grouped_gemm.dot_tiles_wgrad_by_tile(d, xx, tile_expert, E), (dy_p, x_p)),
  }
  for key, (fn, args) in calls.items():
    try:
      ms, outs[key] = jax_time_ms(fn, [args], iters=3)
      row[key], row[key + "_ms"] = tf(ms), ms
    except Exception:  # noqa: BLE001
      log(f"  {key} failed:", traceback.format_exc()[-1500:])
  try:
    import torch  # noqa: PLC0415
    # torch wants every group's rows x 2 bytes a multiple of 16: it runs on the same tile buffer (groups padded to
    # 128 rows with zero rows, which add nothing; ours computes them too)
    a_t = to_torch(dy_p).t().contiguous()  # (N, P)
    b_t = to_torch(x_p).t().contiguous().t()  # (P, K), column-major
    offs = torch.from_numpy(np.cumsum(-(-sizes // 128) * 128).astype(np.int32)).cuda()
    ms, _ = torch_time_ms([lambda: torch._grouped_mm(a_t, b_t, offs=offs, out_dtype=torch.bfloat16)])
    row["torch_gmm"] = tf(ms)
  except Exception:  # noqa: BLE001
    log("  torch._grouped_mm (wgrad) failed:", traceback.format_exc()[-1500:])
  ok = True
  for key, ref, tol in (("fp8_kernel", "fp8_xla", 1e-3), ("bf16", "bf16_xla", 1e-4), ("fp8", "bf16", 0.1)):
    if key in outs and ref in outs:
      a, b = np.asarray(outs[key], np.float32), np.asarray(outs[ref], np.float32)
      row[f"{key}_err"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
      ok = ok and row[f"{key}_err"] <= tol
    else:
      ok = False
  return row, ok


def wgrad_table(rows):
  cols = ("fp8", "fp8_kernel", "fp8_xla", "bf16", "bf16_xla", "torch_gmm")
  lines = ["| shape (NxK) | routing | rows (max group, empty) | fp8 | fp8 kernel | fp8 XLA loops (before) | bf16 | "
           "bf16 XLA loops (before) | torch._grouped_mm BF16 | fp8 / torch | bf16 / torch | err kernel vs XLA "
           "(fp8, bf16) |", "|" + "---|" * 13]
  for r in rows:
    ratio = lambda c: r[c] / r["torch_gmm"] if c in r and "torch_gmm" in r else None  # noqa: E731
    lines.append("| {} {}x{} | {} | {} ({}, {}) | {} | {} | {} | {:.1e}, {:.1e} |".format(
        r["shape"], r["n"], r["k"], r["routing"], r["rows"], r["max_group"], r["empty_groups"],
        " | ".join(fmt(r.get(c)) for c in cols), fmt(ratio("fp8"), "{:.2f}x"), fmt(ratio("bf16"), "{:.2f}x"),
        r.get("fp8_kernel_err", float("nan")), r.get("bf16_err", float("nan"))))
  return "\n".join(lines)


def table(rows):
  cols = ("ours", "ours_kernel", "ours_cross", "dense_loop", "cublas_loop", "ragged_dot", "torch_gmm")
  hdr = ("| shape (NxK) | routing | rows (max group, empty) | ours | ours kernel | ours cross-tile | dense loop "
         "| cuBLAS blockwise loop | XLA ragged_dot BF16 | torch._grouped_mm BF16 | ours/torch | err ours | bitwise "
         "dense |")
  lines = [hdr, "|" + "---|" * 13]
  for r in rows:
    lines.append("| {} {}x{} | {} | {} ({}, {}) | {} | {} | {:.1e} | {} |".format(
        r["shape"], r["n"], r["k"], r["routing"], r["rows"], r["max_group"], r["empty_groups"],
        " | ".join(fmt(r.get(c)) for c in cols), fmt(r.get("ours_vs_torch"), "{:.2f}x"),
        r.get("ours_err", float("nan")), r.get("dense_bitwise", "-")))
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, default=8192, help="tokens per step (routed rows = tokens x 8)")
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--routings", default=",".join(ROUTINGS))
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--no-dense-loop", action="store_true", help="skip the per-expert loop of the dense kernel")
  p.add_argument("--no-ragged-dot", action="store_true", help="skip XLA's ragged_dot")
  p.add_argument("--wgrad", action="store_true", help="the expert weight gradients (module docstring)")
  args = p.parse_args()
  from fp8jax import backends  # noqa: PLC0415
  if not backends.hopper_available():
    print("bench_grouped.py needs an sm_90 (Hopper) GPU", file=sys.stderr)
    return 2
  import torch  # noqa: PLC0415
  log("device:", jax.devices()[0].device_kind, "| jax", jax.__version__, "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "| date", time.strftime("%Y-%m-%d %H:%M:%S"))
  rows, bad = [], 0
  for name in args.shapes.split(","):
    for routing in args.routings.split(","):
      t = time.time()
      row, ok = bench_wgrad_case(name, routing, args.tokens) if args.wgrad else bench_case(name, routing,
                                                                                            args.tokens, args)
      bad += not ok
      rows.append(row)
      log(json.dumps(row), f"({time.time() - t:.1f}s)")
  stem = "bench_grouped_wgrad" if args.wgrad else "bench_grouped"
  with open(os.path.join(args.out, stem + ".json"), "w") as f:
    json.dump({**provenance(packages=("torch",)), "cuda": torch.version.cuda, "rows": rows}, f, indent=1)
  with open(os.path.join(args.out, stem + ".log"), "w") as f:
    f.write("\n".join(LOG))
  if args.wgrad:
    print(f"\nTFLOP/s (2 * routed rows * N * K / median time), wgrad, {args.tokens} tokens x top-{TOP_K}, {E} experts\n"
          + wgrad_table(rows))
    return 1 if bad else 0
  print(f"\nTFLOP/s (2 * routed rows * N * K / median time), {args.tokens} tokens x top-{TOP_K}, {E} experts; "
        f"err: ours vs the exact block math on 4 groups\n" + table(rows))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
