"""Benchmark of the attention op (issue 14) on a CUDA GPU: kernels, decode bandwidth, and the training step's memory.

  PYTHONPATH=. python3 scripts/bench_attention.py [--cases 8x4096,1x16384] [--out DIR]     # kernels + decode
  PYTHONPATH=. python3 scripts/bench_attention.py --train_step [--seqs 8 --seq_len 4096]   # 8B-width fwd+bwd memory

Kernel table (causal, 32 query heads / 8 key-value heads, head_dim 128, BF16), TFLOP/s of
  ours    fp8jax.attention.attend(backend="pallas"): pallas_kernels.attention_triton (forward; custom-VJP backward)
  cudnn   jax.nn.dot_product_attention(implementation="cudnn")  (cuDNN flash attention)
  xla     jax.nn.dot_product_attention(implementation="xla")    (plain XLA: materializes the T x T scores)
Forward FLOPs = 4 B H T^2 D / 2 (causal); backward = 2.5x the forward's (five matmuls instead of two). "bwd" is the
median time of forward + backward minus the forward's. Times are CUPTI kernel times (bench_gemm.jax_time_ms).
Each output is checked against cuDNN's (relative Frobenius error) and ours against the plain-jnp reference.

Decode: one new token per slot over an FP8 / BF16 KV cache (256 slots, ragged lengths), ours vs the whole-cache XLA
attention the model used before this op (einsum over max_len, mask after): time per layer-step and the bandwidth on
the live bytes (the K/V rows each slot actually needs, read once), against the measured device-copy bandwidth.

--train_step: loss = mean next-token NLL of a 2-layer model at Llama-3.1-8B width (FP8 recipe, remat), value and
grad, for each attention implementation in its own process (peak_bytes_in_use is per process): step time (median of
3 after warm-up) and peak device memory. ``--impls`` entries may add ``+whole_head`` (the unchunked output head: one
(N, V) logits tensor and whole-row log-softmax, as before fp8jax.model.head), ``+bf16`` (the BF16 recipe) and
``+xla_norm`` (XLA's RMSNorm fusions instead of the fixed-tile Pallas kernel), ``+xla_gemm`` (cuBLAS for the BF16
GEMMs: with ``+bf16 +xla_norm`` and cudnn attention, the BF16 recipe without any batch-invariant kernel).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_gemm import jax_time_ms, log, LOG  # noqa: E402
from fp8jax import attention as attn  # noqa: E402
from fp8jax import kvcache, ops  # noqa: E402
from fp8jax import backends
from fp8jax.diagnostics.provenance import provenance  # noqa: E402
from pallas_kernels import attention as ref  # noqa: E402

H, KV, D = 32, 8, 128


def rel_err(out, want):
  out, want = jnp.asarray(out, jnp.float32), jnp.asarray(want, jnp.float32)
  return float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))


def _inputs(b, t, seed=0):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(k1, (b, t, H, D), jnp.bfloat16)
  k = jax.random.normal(k2, (b, t, KV, D), jnp.bfloat16)
  v = jax.random.normal(k3, (b, t, KV, D), jnp.bfloat16)
  do = jax.random.normal(k4, (b, t, H, D), jnp.bfloat16)
  return q, k, v, do


def _impls():
  return {
      "ours": lambda q, k, v: attn.attend(q, k, v, backend="pallas"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
      "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
  }


def _fwd_bwd(fn):
  def f(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return vjp(do)
  return f


def kernel_rows(cases):
  rows = []
  for b, t in cases:
    q, k, v, do = jax.block_until_ready(_inputs(b, t, seed=b * t))
    fwd_flops = 4 * b * H * t * t * D / 2
    outs = {}
    for name, fn in _impls().items():
      row = {"case": f"{b}x{t}", "impl": name}
      try:
        ms, out = jax_time_ms(fn, [(q, k, v)], iters=5)
        outs[name] = out
        row.update(fwd_ms=ms, fwd_tflops=fwd_flops / ms / 1e9)
        ms2, grads = jax_time_ms(_fwd_bwd(fn), [(q, k, v, do)], iters=5)
        outs[name + "_grads"] = grads
        row.update(fwd_bwd_ms=ms2, bwd_ms=ms2 - ms, bwd_tflops=2.5 * fwd_flops / max(ms2 - ms, 1e-9) / 1e9)
        mem = jax.jit(_fwd_bwd(fn)).lower(q, k, v, do).compile().memory_analysis()
        row["fwd_bwd_temp_gib"] = getattr(mem, "temp_size_in_bytes", 0) / 2**30
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
        log(f"  {name} {b}x{t} failed:", traceback.format_exc()[-1500:])
      rows.append(row)
      log(json.dumps(row))
    if "cudnn" in outs:
      for row in rows[-3:]:
        n = row["impl"]
        if n in outs and n != "cudnn":
          row["fwd_err_vs_cudnn"] = rel_err(outs[n], outs["cudnn"])
          if n + "_grads" in outs and "cudnn_grads" in outs:
            row["grad_err_vs_cudnn"] = max(rel_err(a, w) for a, w in zip(outs[n + "_grads"], outs["cudnn_grads"]))
    if "ours" in outs and t <= 4096:
      pos = jnp.broadcast_to(jnp.arange(t), (b, t))
      want = jax.jit(lambda q, k, v: ref.attention_reference(q, k, v, pos, *attn._scales(D, None, None))[0])(q, k, v)
      rows[-3]["fwd_err_vs_reference"] = rel_err(outs["ours"], want)
  return rows


def _old_xla_decode(q_BxHxD, ck, cv, pos_B, ks, vs):
  """The model's attention before this op: scores over the whole cache (upcast), masked after, full softmax."""
  b, _, d = q_BxHxD.shape
  g = H // KV
  qg = q_BxHxD.reshape(b, KV, g, d)
  s = jnp.einsum("bkgd,bskd->bkgs", qg, ck.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  s = s * (ks * (1 / math.sqrt(d)))
  s = jnp.where((jnp.arange(ck.shape[1])[None, :] <= pos_B[:, None])[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(jnp.bfloat16)
  out = jnp.einsum("bkgs,bskd->bkgd", p, cv.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  return (out * vs).astype(jnp.bfloat16).reshape(b, H, d)


def _copy_bandwidth():
  x = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB
  ms, _ = jax_time_ms(lambda a: a * 2.0, [(x,)], iters=5)
  return 2 * x.nbytes / ms / 1e6  # GB/s, read + write


def decode_operands(fp8: bool, slots=256, max_len=1536, mean_ctx=1024, key=None):
  """One layer's decode launch: queries (slots, H, D), a random K/V cache (FP8 values x30 with scale 1/30, or BF16),
  each slot's position drawn around ``mean_ctx`` (the same positions for every call) -> (q, ck, cv, pos, kv scale,
  live K/V bytes a length-aware kernel reads)."""
  rng = np.random.default_rng(0)
  pos = jnp.asarray(np.clip(rng.integers(mean_ctx // 2, mean_ctx * 3 // 2, slots), 0, max_len - 1), jnp.int32)
  k1, k2, k3 = jax.random.split(jax.random.key(fp8) if key is None else key, 3)
  dt, amp = (jnp.float8_e4m3fn, 30.0) if fp8 else (jnp.bfloat16, 1.0)
  ck, cv = ((jax.random.normal(k, (slots, max_len, KV, D), jnp.float32) * amp).astype(dt) for k in (k1, k2))
  q = jax.random.normal(k3, (slots, H, D), jnp.bfloat16)
  live = float(np.sum(np.asarray(pos) + 1)) * KV * D * 2 * jnp.dtype(dt).itemsize
  return q, ck, cv, pos, jnp.float32(1 / amp), live


def decode_rows(slots=256, max_len=1536, mean_ctx=1024):
  bw = _copy_bandwidth()
  log(f"device copy bandwidth: {bw:.0f} GB/s")
  rows = []
  for fp8 in (True, False):
    q, ck, cv, pos, ks, live = decode_operands(fp8, slots, max_len, mean_ctx)
    vs = ks
    live += 2 * q.size * 2
    ks_ours = ks if fp8 else None  # BF16 values take no scales (a scale says the K/V are E4M3 codes: attend)
    ours = lambda q, ck, cv, p: attn.attend(q[:, None], ck, cv, p[:, None], k_scale=ks_ours, v_scale=ks_ours,  # noqa
                                           backend="pallas")[:, 0]
    old = lambda q, ck, cv, p: _old_xla_decode(q, ck, cv, p, ks, vs)  # noqa: E731
    impls = (("ours", ours, (ck, cv)), ("xla_whole_cache", old, (ck, cv)))
    if fp8:  # the sampler's FP8 cache: head dims in pair order (fp8jax.kvcache.KVCache.pair_ordered), the 16-row tile
      pairs = lambda q, ck, cv, p: attn.attend(q[:, None], ck, cv, p[:, None], k_scale=ks, v_scale=vs,  # noqa: E731
                                              backend="pallas", pair_ordered=True)[:, 0]
      impls = (("ours_pair_ordered", pairs, (ref.pair_order(ck), ref.pair_order(cv))),
               ("ours_natural_order", ours, (ck, cv)), impls[1])
    outs = {}
    for name, fn, cache in impls:
      row = {"decode": "fp8" if fp8 else "bf16", "impl": name, "slots": slots, "max_len": max_len,
             "mean_ctx": float(np.mean(np.asarray(pos) + 1))}
      try:
        ms, out = jax_time_ms(fn, [(q, *cache, pos)], iters=10)
        outs[name] = out
        row.update(ms_per_layer=ms, live_gb=live / 1e9, live_gbps=live / ms / 1e6, frac_of_copy_bw=live / ms / 1e6 / bw)
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
        log(f"  decode {name} failed:", traceback.format_exc()[-1500:])
      rows.append(row)
    for r in rows[-len(impls):]:
      if r["impl"] in outs and r["impl"] != "xla_whole_cache" and "xla_whole_cache" in outs:
        r["err_vs_xla"] = rel_err(outs[r["impl"]], outs["xla_whole_cache"])
      log(json.dumps(r))
  return rows, bw


def rollout_decode_operands(prompts=16, samples=16, prompt_len=512, own_len=512, max_own=1024, key=None):
  """One layer of the sampler's decode at the rollout's shape: a paged FP8 cache in pair order (random codes x30,
  scale 1/30), ``prompts`` prompts of ``prompt_len`` tokens whose pages their ``samples`` slots share (the blocks
  below the one holding the last prompt token, as ``fp8jax.sampler`` lays them out), each slot ``own_len`` tokens
  past its prompt on its own pages -> (q, k pool, v pool, pos, page table, shared blocks, scale, live bytes: each
  shared page counted once, as the prefix pass reads it)."""
  page = ref.BLOCK_KV
  slots = prompts * samples
  shared = (prompt_len - 1) // page
  pos = prompt_len - 1 + own_len
  n_own = -(-(prompt_len + max_own) // page) - shared  # own blocks a slot needs at the longest
  table = np.zeros((slots, shared + n_own), np.int32)
  for s in range(slots):
    table[s, :shared] = (s // samples) * shared + np.arange(shared)
    table[s, shared:] = prompts * shared + s * n_own + np.arange(n_own)
  n_pages = prompts * shared + slots * n_own
  k1, k2, k3 = jax.random.split(jax.random.key(5) if key is None else key, 3)
  kp, vp = ((jax.random.normal(k, (n_pages, page, KV, D), jnp.float32) * 30).astype(jnp.float8_e4m3fn)
            for k in (k1, k2))
  q = jax.random.normal(k3, (slots, H, D), jnp.bfloat16)
  own_blocks = pos // page + 1 - shared
  live = (prompts * shared + slots * own_blocks) * page * KV * D * 2
  return (q, kp, vp, jnp.full((slots,), pos, jnp.int32), jnp.asarray(table), jnp.full((slots,), shared, jnp.int32),
          jnp.float32(1 / 30), live)


def _cfg_diff(cfg) -> str:
  """A tuning config as its fields that differ from the default ("default" if none)."""
  import dataclasses  # noqa: PLC0415
  d = type(cfg)()
  diff = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
          if getattr(cfg, f.name) != getattr(d, f.name)]
  return " ".join(diff) or "default"


def rollout_decode_configs():
  """Decode-pass and shared-prefix-pass settings timed by ``--rollout_decode`` (the default first; the sweep of
  2026-12-04, docs/history.md)."""
  from pallas_kernels import attention_triton as kern  # noqa: PLC0415
  TC = kern.TuningConfig
  return [TC(), TC(decode_num_stages=2), TC(decode_num_warps=2), TC(prefix_block_q=64), TC(prefix_num_stages=3)]


def rollout_decode_rows(own_lens=(128, 512, 1024), shapes=((16, 16, 512),)):
  """The sampler's decode attention at the rollout's shape (shared prompt pages, FP8 pair-ordered cache), for each
  config of ``rollout_decode_configs`` and own length: CUPTI time of the whole call (prefix pass + decode pass), and
  the decode pass alone over every block (``shared_blocks=None``); outputs checked bitwise against the default."""
  from pallas_kernels import attention_triton as kern  # noqa: PLC0415
  bw = _copy_bandwidth()
  rows = []
  for (prompts, samples, prompt_len), own in itertools.product(shapes, own_lens):
    q, kp, vp, pos, table, shared, sc, live = rollout_decode_operands(prompts, samples, prompt_len, own)
    qs, vs = attn._scales(D, sc, sc)
    base = {}
    for cfg in rollout_decode_configs():
      row = {"shape": f"{prompts}x{samples}x{prompt_len}", "own_len": own, "config": _cfg_diff(cfg),
             "live_gb": live / 1e9}
      try:
        for name, sb in (("shared", shared), ("plain", None)):
          fn = lambda q, kp, vp, p, t, sb=sb, c=cfg: kern.attention_heads(  # noqa: E731
              q, kp, vp, p, qs, vs, t, sb, config=c, pair_ordered=True)
          ms, out = jax_time_ms(fn, [(q, kp, vp, pos, table)], iters=10)
          row[f"{name}_us"] = ms * 1e3
          out = np.asarray(out)
          base.setdefault(name, out)
          row[f"{name}_bitwise_default"] = bool(np.array_equal(out, base[name]))
        row["shared_eq_plain"] = bool(np.array_equal(base["shared"], base["plain"]))  # the prefix pass's promise
        row["shared_frac_of_copy_bw"] = live / (row["shared_us"] * 1e-6) / 1e9 / bw
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
        log(f"  rollout decode {cfg} failed:", traceback.format_exc()[-1500:])
      rows.append(row)
      log(json.dumps(row))
  return rows, bw


def ncu_rollout_decode(own_len=512, iters=3):
  """The default decode call at the rollout's shape, ``iters`` times, for Nsight Compute (no timing harness)."""
  from pallas_kernels import attention_triton as kern  # noqa: PLC0415
  q, kp, vp, pos, table, shared, sc, _ = rollout_decode_operands(own_len=own_len)
  qs, vs = attn._scales(D, sc, sc)
  f = jax.jit(lambda q, kp, vp, p, t, sb: kern.attention_heads(q, kp, vp, p, qs, vs, t, sb, pair_ordered=True))
  for _ in range(iters):
    jax.block_until_ready(f(q, kp, vp, pos, table, shared))
  return 0


# ------------------------------------------------------------------------------------------------------------------
# Training step at 8B width (one process per attention implementation)
# ------------------------------------------------------------------------------------------------------------------


def _whole_head(w, h_NxD, tokens_N, lcfg, temperature=1.0):
  """The head before the chunked one: one (N, V) FP32 logits GEMM, whole-row log-softmax (benchmark-local)."""
  import dataclasses  # noqa: PLC0415
  from fp8jax.model import head  # noqa: PLC0415
  lg = ops.linear(h_NxD, w, dataclasses.replace(lcfg, out_dtype="float32"))
  return head.reference_logprobs_and_entropy(lg, tokens_N, temperature)


def _train_step_child(impl_spec: str, seqs: int, seq_len: int, layers: int):
  """impl_spec = attention ('ours' | 'cudnn' | 'xla_einsum') + optional '+whole_head' (the unchunked output head)
  and '+bf16' (the BF16 recipe instead of FP8), '+xla_norm' (XLA's RMSNorm instead of the fixed-tile kernel) and
  '+xla_gemm' (fp8.gemm_backend='xla': cuBLAS for BF16 GEMMs, the XLA reference for FP8 ones)."""
  from fp8jax import recipes  # noqa: PLC0415
  from fp8jax.model import ModelConfig, head, init_params  # noqa: PLC0415
  from fp8jax.rl.learner import Policy  # noqa: PLC0415

  impl, *variants = impl_spec.split("+")
  if "whole_head" in variants:
    head.logprobs_and_entropy = _whole_head
  if impl in ("cudnn", "xla_einsum"):  # the same model code on another attention (benchmark-local substitution)
    kind = "cudnn" if impl == "cudnn" else "xla"

    def other(q, k, v, positions_BxT=None, *, k_scale=None, v_scale=None, backend="auto", mesh=None):
      del backend, mesh, positions_BxT
      scale = (1.0 if k_scale is None else k_scale) / math.sqrt(q.shape[-1])
      out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=kind)
      return out if v_scale is None else (out.astype(jnp.float32) * v_scale).astype(q.dtype)
    attn.attend = other
  cfg = ModelConfig(vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, head_dim=128,
                    ffn_dim=14336, rope_theta=500000.0, max_seq_len=seq_len, remat=True,
                    attn_backend="pallas" if impl == "ours" else "xla",
                    norm_backend="xla" if "xla_norm" in variants else "auto")
  params = init_params(cfg, seed=0)
  recipe = recipes.Recipe(mode="bf16" if "bf16" in variants else "fp8",
                        gemm_backend="xla" if "xla_gemm" in variants else "auto")
  policy = Policy(cfg, ops.LinearConfig.from_recipe(recipe), recipe)  # the trainer's log-probs
  toks = jax.random.randint(jax.random.key(1), (seqs, seq_len), 0, cfg.vocab_size)

  def loss(p, t):
    lp, _, _ = policy.logprobs(p, t)
    return -jnp.mean(lp)

  step = fp8jax.jit(jax.value_and_grad(loss))
  t0 = time.perf_counter()
  jax.block_until_ready(step(params, toks))
  compile_s = time.perf_counter() - t0
  ts = []
  for _ in range(3):
    t0 = time.perf_counter()
    val, _ = jax.block_until_ready(step(params, toks))
    ts.append(time.perf_counter() - t0)
  stats = jax.devices()[0].memory_stats() or {}
  return {"impl": impl_spec, "seqs": seqs, "seq_len": seq_len, "layers": layers, "step_s": statistics.median(ts),
          "first_call_s": compile_s, "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30, "loss": float(val),
          "gemm_backends": backends.backend_report()}


def train_step_rows(seqs, seq_len, layers, impls):
  rows = []
  for impl in impls:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", impl, "--seqs", str(seqs), "--seq_len",
           str(seq_len), "--layers", str(layers)]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    out = [ln for ln in res.stdout.splitlines() if ln.startswith("CHILD ")]
    row = json.loads(out[-1][6:]) if out else {"impl": impl, "error": res.stderr[-1500:]}
    row["wall_s"] = time.time() - t0
    rows.append(row)
    log(json.dumps(row))
  return rows


def _bitwise_decode_equals_training(cfg, kern, b=4, t=1500):
  """For tile config ``cfg``: decode rows (heads tiles over a stale cache) == training rows, FP8 and BF16 K/V."""
  ok = True
  for fp8 in (False, True):
    q, k, v, _ = _inputs(b, t, seed=7 + fp8)
    ks = vs = jnp.float32(1.0)
    if fp8:
      ks, vs = jnp.float32(4 / 448), jnp.float32(4 / 448)
      k, v = kvcache.quantize_kv(k, ks), kvcache.quantize_kv(v, vs)
    qs, vsc = attn._scales(D, ks, vs)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    # The trainer's codes reach the kernel as FP16 values (exact; fp8jax.attention._flash_train).
    tk, tv = (k.astype(jnp.float16), v.astype(jnp.float16)) if fp8 else (k, v)
    train, _ = kern.attention_seq(q, tk, tv, pos, qs, vsc, config=cfg)
    s = kvcache.padded_len(t + 200)
    ck = jnp.zeros((b, s, KV, D), k.dtype).at[:, :t].set(k)
    cv = jnp.full((b, s, KV, D), jnp.nan, jnp.float32).astype(v.dtype).at[:, :t].set(v)
    ps = jnp.asarray(np.random.default_rng(t + fp8).integers(0, t, b), jnp.int32)
    dec = kern.attention_heads(q[jnp.arange(b), ps], ck, cv, ps, qs, vsc, config=cfg)
    ok &= bool(np.array_equal(np.asarray(dec), np.asarray(train[jnp.arange(b), ps])))
  return ok


def sweep_configs(which: str):
  """The configs of a sweep: "tiles" (row tiles and pipelines). (The operand forms for FP8 K/V codes, BF16 / FP16 /
  E4M3, were swept at d116623, TuningConfig.fp8_operands; FP16 is now the contract.)"""
  from pallas_kernels import attention_triton as kern  # noqa: PLC0415
  TC = kern.TuningConfig
  if which == "tiles":
    return [TC(), TC(decode_block_q=16, decode_num_warps=1), TC(decode_block_q=16, decode_num_warps=4),
            TC(decode_block_q=32, decode_num_warps=2), TC(decode_block_q=64, decode_num_warps=4, decode_num_stages=3)]
  raise ValueError(f"--sweep_set must be tiles, got {which!r}")


def sweep_rows(which="tiles", b=8, t=4096, slots=256, max_len=1536, mean_ctx=1024):
  """Tile / pipeline configs side by side: training forward, fwd+bwd, decode (FP8 and BF16 K/V), and whether the
  config's decode rows equal its training rows bit for bit."""
  from pallas_kernels import attention_triton as kern  # noqa: PLC0415
  TC = kern.TuningConfig
  fwd_cfgs = sweep_configs(which)
  bwd_cfgs = [TC()]
  q, k, v, do = jax.block_until_ready(_inputs(b, t, seed=3))
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  qs, vsc = attn._scales(D, None, None)
  kv_scale = jnp.float32(4 / 448)  # the training forward over FP8 K/V codes (the FP8 KV recipe's operands)
  k8, v8 = kvcache.quantize_kv(k, kv_scale), kvcache.quantize_kv(v, kv_scale)
  qs8, vsc8 = attn._scales(D, kv_scale, kv_scale)
  fwd_flops = 4 * b * H * t * t * D / 2
  caches = {fp8: decode_operands(fp8, slots, max_len, mean_ctx, key=jax.random.key(10 + fp8)) for fp8 in (True, False)}
  rows = []
  for kind, cfgs in (("fwd", fwd_cfgs), ("bwd", bwd_cfgs)):
    for cfg in cfgs:
      row = {"kind": kind, "config": str(cfg)}
      try:
        if kind == "fwd":
          ms, _ = jax_time_ms(lambda q, k, v, c=cfg: kern.attention_seq(q, k, v, pos, qs, vsc, config=c)[0],
                              [(q, k, v)])
          row.update(fwd_ms=ms, fwd_tflops=fwd_flops / ms / 1e9)
          ms, _ = jax_time_ms(lambda q, k, v, c=cfg: kern.attention_seq(q, k, v, pos, qs8, vsc8, config=c)[0],
                              [(q, k8, v8)])
          row.update(fwd_fp8kv_ms=ms, fwd_fp8kv_tflops=fwd_flops / ms / 1e9)
          for fp8, (dq_, ck, cv, dpos, _, live) in caches.items():
            ms, _ = jax_time_ms(lambda q, ck, cv, p, c=cfg: kern.attention_heads(q, ck, cv, p, qs, vsc, config=c),
                                [(dq_, ck, cv, dpos)], iters=10)
            row["decode_fp8_us" if fp8 else "decode_bf16_us"] = ms * 1e3
            row["decode_fp8_gbps" if fp8 else "decode_bf16_gbps"] = live / ms / 1e6
          row["bitwise_decode_eq_train"] = _bitwise_decode_equals_training(cfg, kern)
        else:
          f = lambda q, k, v, do, c=cfg: jax.vjp(lambda q, k, v: attn._flash_train(q, k, v, qs, vsc, c),  # noqa
                                                 q, k, v)[1](do)
          ms, _ = jax_time_ms(f, [(q, k, v, do)])
          row.update(fwd_bwd_ms=ms)
      except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
        log(f"  sweep {cfg} failed:", traceback.format_exc()[-1500:])
      rows.append(row)
      log(json.dumps(row))
  return rows


def fmt(x, f="{:.0f}"):
  return "-" if x is None else f.format(x)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--cases", default="8x4096,1x16384")
  p.add_argument("--no_decode", action="store_true")
  p.add_argument("--train_step", action="store_true")
  p.add_argument("--sweep", action="store_true", help="tile / pipeline configs side by side (and their bits)")
  p.add_argument("--sweep_set", default="tiles", help="tiles (sweep_configs)")
  p.add_argument("--rollout_decode", action="store_true",
                 help="decode attention at the rollout's shape (shared prompt pages), per decode / prefix config")
  p.add_argument("--own_lens", default="128,512,1024", help="--rollout_decode: tokens past the prompt per slot")
  p.add_argument("--rollout_shapes", default="16x16x512,8x32x512,16x16x2048",
                 help="--rollout_decode: prompts x samples x prompt tokens (slots = prompts x samples)")
  p.add_argument("--ncu_target", action="store_true", help="run the rollout-shaped decode call for ncu, untimed")
  p.add_argument("--seqs", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=4096)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--impls", default="ours,cudnn,xla_einsum")
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--_child", default=None)
  a = p.parse_args()
  if a._child:
    print("CHILD " + json.dumps(_train_step_child(a._child, a.seqs, a.seq_len, a.layers)), flush=True)
    return 0
  if a.ncu_target:
    return ncu_rollout_decode()
  log("device:", jax.devices()[0].device_kind, "| jax", jax.__version__, "| date", time.strftime("%Y-%m-%d %H:%M:%S"))
  result = provenance()
  if a.sweep:
    result["sweep"] = rows = sweep_rows(a.sweep_set)
    name = "attention_sweep.json"
    table = [f"{'kind':4s} {'fwd TF/s':>8s} {'fwd fp8kv':>9s} {'fwd+bwd ms':>10s} {'dec fp8 GB/s':>12s} "
             f"{'dec bf16 GB/s':>13s} {'bitwise':>7s}  config"]
    table += [f"{r['kind']:4s} {fmt(r.get('fwd_tflops')):>8s} {fmt(r.get('fwd_fp8kv_tflops')):>9s} "
              f"{fmt(r.get('fwd_bwd_ms'), '{:.2f}'):>10s} "
              f"{fmt(r.get('decode_fp8_gbps')):>12s} {fmt(r.get('decode_bf16_gbps')):>13s} "
              f"{str(r.get('bitwise_decode_eq_train', '-')):>7s}  {r['config']}" + (" ERROR" if "error" in r else "")
              for r in rows]
  elif a.rollout_decode:
    shapes = [tuple(int(x) for x in c.split("x")) for c in a.rollout_shapes.split(",")]
    rows, bw = rollout_decode_rows(tuple(int(x) for x in a.own_lens.split(",")), shapes)
    result["rollout_decode"], result["copy_gbps"] = rows, bw
    name = "attention_rollout_decode.json"
    table = [f"rollout decode (prompts x samples x prompt tokens), FP8 pair-ordered pages; copy bw {bw:.0f} GB/s",
             f"{'shape':>12s} {'own':>5s} {'shared us':>9s} {'of bw':>6s} {'plain us':>9s} {'bits':>5s}  config"]
    table += [f"{r['shape']:>12s} {r['own_len']:5d} {fmt(r.get('shared_us'), '{:.1f}'):>9s} "
              f"{fmt(r.get('shared_frac_of_copy_bw'), '{:.2f}'):>6s} {fmt(r.get('plain_us'), '{:.1f}'):>9s} "
              f"{str(r.get('shared_bitwise_default', '-') and r.get('plain_bitwise_default', '-'))[:5]:>5s}  "
              f"{r['config']}" + (" ERROR" if "error" in r else "") for r in rows]
  elif a.train_step:
    result["train_step"] = rows = train_step_rows(a.seqs, a.seq_len, a.layers, a.impls.split(","))
    name = "attention_train_step.json"
    table = [f"{'impl':12s} {'seqs x len':>11s} {'step s':>8s} {'peak GiB':>9s} {'loss':>8s}"]
    table += [f"{r['impl']:12s} {str(r.get('seqs')) + 'x' + str(r.get('seq_len')):>11s} "
              f"{fmt(r.get('step_s'), '{:.3f}'):>8s} {fmt(r.get('peak_gib'), '{:.1f}'):>9s} "
              f"{fmt(r.get('loss'), '{:.4f}'):>8s}" + (" ERROR" if "error" in r else "") for r in rows]
  else:
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    result["kernels"] = rows = kernel_rows(cases)
    table = [f"{'case':9s} {'impl':6s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} {'fwd ms':>8s} {'bwd ms':>8s} "
             f"{'temp GiB':>9s} {'err vs cudnn':>13s}"]
    table += [f"{r['case']:9s} {r['impl']:6s} {fmt(r.get('fwd_tflops')):>9s} {fmt(r.get('bwd_tflops')):>9s} "
              f"{fmt(r.get('fwd_ms'), '{:.2f}'):>8s} {fmt(r.get('bwd_ms'), '{:.2f}'):>8s} "
              f"{fmt(r.get('fwd_bwd_temp_gib'), '{:.2f}'):>9s} "
              f"{fmt(r.get('fwd_err_vs_cudnn'), '{:.1e}'):>13s}" + (" ERROR" if "error" in r else "") for r in rows]
    if not a.no_decode:
      drows, bw = decode_rows()
      result["decode"], result["copy_gbps"] = drows, bw
      table += ["", f"decode (256 slots, mean ctx {drows[0]['mean_ctx']:.0f}, one layer; copy bw {bw:.0f} GB/s)",
                f"{'kv':5s} {'impl':16s} {'us/layer':>9s} {'live GB/s':>10s} {'of copy bw':>10s}"]
      table += [f"{r['decode']:5s} {r['impl']:16s} {fmt(r.get('ms_per_layer') and r['ms_per_layer'] * 1e3):>9s} "
                f"{fmt(r.get('live_gbps')):>10s} {fmt(r.get('frac_of_copy_bw'), '{:.2f}'):>10s}" for r in drows]
    kind = jax.devices()[0].device_kind
    card = next((c for c in ("h100", "h200") if c in kind.lower()), "".join(ch for ch in kind.lower() if ch.isalnum()))
    name = f"attention_{card}.json"
  result["backends"] = backends.backend_report()
  with open(os.path.join(a.out, name), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(a.out, name.replace(".json", ".log")), "w") as f:
    f.write("\n".join(LOG))
  print("\n" + "\n".join(table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
