"""Rollout throughput (issue 6): fp8jax's sampler with BF16 weights, FP8 weights, FP8 weights + FP8 KV cache, and
tunix's native JAX sampler as the peer, on Llama-3.1-8B shapes with random weights (no download).

  PYTHONPATH=. python3 scripts/bench_rollout.py --out /tmp/bench_rollout.json          # budgeted (below)
  PYTHONPATH=. python3 scripts/bench_rollout.py --full --out ...                       # the issue's workload
  PYTHONPATH=. python3 scripts/bench_rollout.py --tiny --out /tmp/tiny.json            # CPU smoke test, < 1 min

Workloads (each config runs each one twice: the first call compiles, the second is timed):
  uniform    --slots prompts of --prompt_len random tokens, 1 sample each, no stop token: every request runs to
             exactly --max_new tokens (the issue's 256 x (512 -> 1024)). --samples N: slots / N prompts, N samples
             each (the samples of a prompt share its pages, and decode attention reads them once per step).
             --prompts P (with --samples N): P prompts x N samples, more requests than slots when P x N > slots
             (the recipes' 64 x 32 on 256 slots: finished slots take waiting requests inside the jitted loop). The
             JSON gives the pool's bytes (kv_cache_bytes) and what it would take with every slot holding its own
             copy of its prompt's pages (kv_cache_bytes_if_copied); the *_noshare configs read the prompt pages per
             slot, as a copy would.
  long_tail  the same prompts, 2 samples each (--long_tail_samples; 2 x slots requests, one prefill per prompt), with a stop set of
             ~vocab * 4 / max_new random token ids: with near-uniform random-weight logits a completion stops after
             a roughly geometric number of tokens (mean ~max_new / 4) or at --max_new. The sampler has no
             per-request max length, so the stop set makes the tail; the JSON records the length distribution.
Presets: the default keeps Llama-3.1-8B widths but --layers 8 and --max_new 512 so that the whole run (3 configs x
2 workloads + tunix, each compiled once) fits in ~7 minutes of an H200: compile time of the decode loop (every
layer unrolled in the loop body, one program per config and workload) and of the prefill dominates, not decoding.
--full = 32 layers, --max_new 1024 (compile ~4x longer; budget a whole 10-minute call, or run configs separately
with --configs). --tiny = a 2-layer, 256-wide model for CPU. Any explicit flag overrides its preset.
--model_config=configs/moonlight16b_fp8.py (any recipe) takes the architecture from a recipe's ``model`` group instead
of Llama-3.1-8B's (--layers still sets the depth; --dim, --heads, ... are then refused) and the recipe's
fp8.keep_patterns for the FP8 configs: e.g. MLA with its latent cache (one (kv_lora_rank + qk_rope_head_dim) vector
per token and layer) and the DeepSeek-V3 MoE. The tunix peer (Llama only) is skipped for such a model.

Columns:
  tok/s      generated tokens / decode wall time (generate_s - prefill_s, host syncs and slot refills included)
  e2e tok/s  generated tokens / whole generate() wall time (prefill included): what is compared with tunix, whose
             sampler is timed end to end (its call also detokenizes on the host, with a trivial id tokenizer here)
  vs bf16    tok/s over fp8jax BF16's tok/s on the same workload
  mem roof   decode memory roofline fraction = T_mem / T_decode with
               T_mem = (W_bytes * decode_steps + KV_bytes) / 4.8e12 B/s,
               W_bytes = bytes of every weight read per step (linear weights in their storage dtype, FP8 scales,
                         BF16 lm_head; the embedding gather is negligible),
               KV_bytes = sum over requests r and their generated tokens i of (prompt_len_r + i) * L * 2 * Hkv * hd
                          * (1 byte FP8 | 2 bytes BF16): the K/V each decode step must read for its live context.
             The whole-cache XLA attention used before the attention kernels read every (slots x max_len) entry
             each step; that larger number stays in the JSON as kv_bytes_read_by_xla_attention, for comparison.
             (MLA: (prompt_len_r + i) * L * (kv_lora_rank + qk_rope_head_dim) * (1 | 2 bytes), the latent cache).
  flop roof  T_flop / T_decode with T_flop = 2 * tokens * active linear params / peak_w + 2 * sum(context) * Hq *
             (k_dim + v_dim) * L / 989e12, peak_w = 989e12 (BF16) or 1979e12 (FP8) dense FLOP/s of the H200;
             k_dim = v_dim = head_dim (GQA), k_dim = kv_lora_rank + qk_rope_head_dim, v_dim = kv_lora_rank (MLA,
             absorbed); an MoE layer's experts count n_experts_per_tok / n_experts of their parameters.
  prefill    prefill tokens/s (distinct prompts only: the samples of a prompt share one prefill).
  occ        mean occupancy: busy slot-steps / (decode steps x slots).
  occ bound  the occupancy these requests' lengths allow: generated tokens / (steps of the ideal first-come-first-
             served schedule, ``sampler.fcfs_decode_steps``, x slots); below 1 when the queue drains and the last
             requests run on alone (scripts/occupancy_bound.py estimates it for other workloads).
Attention runs fp8jax.attention (on a GPU the Pallas kernels: decode reads each slot's filled cache blocks only,
FP8 K/V upcast in registers). What is still plain XLA: RoPE, norms, sampling, the KV write (scatter). The FP8 GEMMs run the Pallas Hopper kernel
on sm_90 when it loads, else the exact XLA block reference (slow): backends.backend_report() is printed and saved. BF16
GEMMs (the lm_head, every linear of bf16) run the batch-invariant BF16 kernel and RMSNorm its fixed-tile kernel; the
configs bf16_cublas (cuBLAS BF16 GEMMs + XLA RMSNorm) and fp8kv_xla_norm (XLA RMSNorm) put the shape-dependent
pieces back, to measure the price of the exact one engine beside bf16 / fp8kv in one run. fp8kv_nofuse / bf16_nofuse
run q/k/v and gate/up as separate GEMMs (the sampler fuses them on the Hopper kernels: fp8jax.model.fuse).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import time
import traceback
import warnings

# JAX takes 75% of GPU memory up front by default; the tunix peer's decode (a 43 GiB cache and its updated copy at
# 256 x 1024 positions, 32 layers) then fails beside fp8jax's live weights. Take 95% unless the caller chose.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import kvcache as kvc
from fp8jax import backends, ops, recipes
from fp8jax import sampler as smp
from fp8jax.config_utils import load_config_file
from fp8jax.diagnostics.provenance import package_version, provenance
from fp8jax.model import llama, schema
from fp8jax.model.config import ModelConfig

HBM_BYTES_PER_S = 4.8e12  # H200
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}  # H200 dense
CONFIGS = {  # name -> (recipe, kv cache)
    "bf16": (recipes.Recipe(mode="bf16"), "bf16"),
    "fp8": (recipes.Recipe(), "bf16"),
    "fp8kv": (recipes.Recipe(kv_cache="fp8"), "fp8"),
    # the price of the exact one engine (issue 15), measured beside "bf16" / "fp8kv": the batch-invariant pieces
    # swapped for the shape-dependent ones (cuBLAS BF16 GEMMs, XLA RMSNorm); attention stays the Pallas op, whose
    # XLA twin reads the whole cache and is no fair peer
    "bf16_cublas": (recipes.Recipe(mode="bf16", gemm_backend="xla"), "bf16"),
    "fp8kv_xla_norm": (recipes.Recipe(kv_cache="fp8"), "fp8"),
    # the decode attention's shared-prefix pass off (each slot reads its prompt's pages itself): measured beside
    # "fp8kv" / "bf16" on a workload with --samples > 1
    "fp8kv_noshare": (recipes.Recipe(kv_cache="fp8"), "fp8"),
    "bf16_noshare": (recipes.Recipe(mode="bf16"), "bf16"),
    # q/k/v and gate/up as separate GEMMs (the sampler fuses them on the Hopper kernels: fp8jax.model.fuse)
    "fp8kv_nofuse": (recipes.Recipe(kv_cache="fp8"), "fp8"),
    "bf16_nofuse": (recipes.Recipe(mode="bf16"), "bf16"),
}
MODEL_OVERRIDES = {"bf16_cublas": {"norm_backend": "xla"}, "fp8kv_xla_norm": {"norm_backend": "xla"}}
SAMPLER_OVERRIDES = {"fp8kv_noshare": {"shared_prefix_attention": False},
                     "bf16_noshare": {"shared_prefix_attention": False},
                     "fp8kv_nofuse": {"fuse_projections": False}, "bf16_nofuse": {"fuse_projections": False}}
PRESETS = {
    "default": dict(layers=8, dim=4096, ffn_dim=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, slots=256,
                    prompt_len=512, max_new=512, decode_chunk=16),
    "full": dict(layers=32, dim=4096, ffn_dim=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, slots=256,
                 prompt_len=512, max_new=1024, decode_chunk=16),
    "tiny": dict(layers=2, dim=256, ffn_dim=512, heads=4, kv_heads=2, head_dim=64, vocab=512, slots=8, prompt_len=32,
                 max_new=32, decode_chunk=4),
}


def log(*a):
  print(*a, flush=True)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  g = p.add_mutually_exclusive_group()
  g.add_argument("--full", action="store_true", help="32 layers, max_new 1024 (the issue's workload)")
  g.add_argument("--tiny", action="store_true", help="tiny model for a CPU smoke test")
  for name in PRESETS["default"]:  # decode_chunk: decode steps per jitted call (the slot refill granularity)
    p.add_argument(f"--{name}", type=int, default=None, help=f"default: {PRESETS['default'][name]} (preset)")
  p.add_argument("--model_config", default=None,
                 help="a recipe (configs/*.py) whose model group and fp8.keep_patterns replace Llama-3.1-8B's")
  p.add_argument("--configs", default="bf16,fp8,fp8kv", help="comma list of " + ",".join(CONFIGS))
  p.add_argument("--workloads", default="uniform,long_tail", help="comma list of uniform,long_tail")
  p.add_argument("--samples", type=int, default=1,
                 help="samples per prompt of the uniform workload (slots / this distinct prompts): the GRPO shape, "
                      "whose samples share their prompt's pages")
  p.add_argument("--prompts", type=int, default=None,
                 help="distinct prompts of the uniform workload (default: slots / --samples); requests = this x "
                      "--samples, which may exceed the slots")
  p.add_argument("--long_tail_samples", type=int, default=2,
                 help="samples per prompt of the long_tail workload (requests = slots x this): more than 2 keeps a "
                      "queue of waiting requests, which is what slot refills are for")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--kv_margin", type=float, default=1.25, help="FP8 KV scale margin over the calibrated amax")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no_tunix", action="store_true", help="skip the tunix peer")
  p.add_argument("--no_warmup", action="store_true", help="time the first (compiling) call instead of a second one")
  p.add_argument("--out", default=None, help="JSON results path (rewritten after every run)")
  p.add_argument("--profile", action="store_true",
                 help="trace one decode chunk in the middle of each timed run (jax.profiler) and record its device "
                      "kernels, grouped by name, in the JSON (top ones printed); the trace goes next to --out")
  p.add_argument("--budget_s", type=float, default=None,
                 help="skip runs that would end past this many seconds (default: 360, --full 540, --tiny 600)")
  args = p.parse_args(argv)
  arch_flags = [f"--{k}" for k in ("dim", "ffn_dim", "heads", "kv_heads", "head_dim", "vocab")
                if getattr(args, k) is not None]
  if args.model_config and arch_flags:
    p.error(f"{', '.join(arch_flags)} with --model_config={args.model_config}: the architecture comes from the recipe "
            "(only --layers overrides it)")
  preset = PRESETS["full" if args.full else "tiny" if args.tiny else "default"]
  for k, v in preset.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  if args.samples < 1 or (args.samples > 1 and not args.no_tunix):
    p.error(f"--samples={args.samples}: must be >= 1, and > 1 needs --no_tunix (the tunix peer runs 1 sample per "
            "prompt)")
  if args.prompts is not None and args.prompts < 1:
    p.error(f"--prompts={args.prompts}: must be >= 1")
  args.preset = "full" if args.full else "tiny" if args.tiny else "default"
  if args.budget_s is None:
    args.budget_s = {"default": 360.0, "full": 540.0, "tiny": 600.0}[args.preset]
  args.configs = [c for c in args.configs.split(",") if c]
  args.workloads = [w for w in args.workloads.split(",") if w]
  bad = [c for c in args.configs if c not in CONFIGS] + [w for w in args.workloads if w not in ("uniform", "long_tail")]
  if bad:
    p.error(f"unknown --configs/--workloads entries: {bad}")
  return args


def model_config(a) -> ModelConfig:
  """Llama-3.1-8B architecture (RoPE theta 500k, Llama-3 frequency scaling) at the requested sizes, or the
  --model_config recipe's architecture --layers deep."""
  if a.model_config:
    m = ModelConfig.from_config(load_config_file(a.model_config).model)
    return dataclasses.replace(m, n_layers=a.layers, max_seq_len=max(m.max_seq_len, a.prompt_len + a.max_new))
  return ModelConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads,
                     head_dim=a.head_dim, ffn_dim=a.ffn_dim, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192),
                     max_seq_len=max(8192, a.prompt_len + a.max_new))


def recipe_of(a, name: str) -> recipes.Recipe:
  """The quantization recipe of a --configs entry: with --model_config, that recipe's fp8.keep_patterns kept BF16."""
  recipe = CONFIGS[name][0]
  if a.model_config and recipe.mode != "bf16":
    recipe = dataclasses.replace(recipe, keep_patterns=tuple(load_config_file(a.model_config).fp8.keep_patterns))
  return recipe


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
  """Random token ids in [1, vocab): 0 stays free as tunix's (left) pad id."""
  rng = np.random.default_rng(seed)
  return rng.integers(1, vocab, size=(n, length)).tolist()


def long_tail_stop_ids(vocab: int, max_new: int, seed: int) -> tuple[int, ...]:
  """~vocab * 4 / max_new random ids: per-step stop probability ~4 / max_new under near-uniform logits."""
  k = max(1, min(vocab - 1, round(vocab * 4 / max_new)))
  rng = np.random.default_rng(seed + 1)
  return tuple(int(t) for t in np.sort(rng.choice(np.arange(1, vocab), size=k, replace=False)))


# ------------------------------------------------------------------------------------------------------------------
# Rooflines
# ------------------------------------------------------------------------------------------------------------------


def weight_bytes_per_step(params, cfg: ModelConfig) -> int:
  """Bytes of all weights a decode step reads: linear weights (+ FP8 scales), norms, the lm_head; not the
  embedding table (a gather of one row per slot) unless it is also the (tied) output head."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if "'embed'" in jax.tree_util.keystr(path) and not cfg.tie_embeddings:
      continue
    total += leaf.size * leaf.dtype.itemsize
  return total


def linear_params(cfg: ModelConfig) -> float:
  """Parameters of the matrices a generated token multiplies (the schema's 2-D+ weights, MLA's absorbed kv_b
  included; an MoE layer's stacked experts times n_experts_per_tok / n_experts), plus the output head."""
  n = 0.0
  for i in range(cfg.n_layers):
    for p in schema.LAYER:
      shape = tuple(p.shape(cfg)) if p.present(cfg, i) else ()
      if len(shape) >= 2:
        n += math.prod(shape) * (cfg.n_experts_per_tok / cfg.n_experts if p.stacked else 1.0)
  return n + cfg.vocab_size * cfg.dim


def roofline(cfg: ModelConfig, ro: smp.Rollout, w_bytes: int, kv_fp8: bool, weights_fp8: bool, slots: int,
             max_len: int, decode_s: float) -> dict:
  """Memory and compute roofline times of the decode phase of ``ro`` (formulas: module docstring)."""
  heads, hd, has_v = cfg.kv_cache_layout
  kv_token_bytes = cfg.n_layers * (2 if has_v else 1) * heads * hd * (1 if kv_fp8 else 2)
  k_dim, v_dim = (cfg.latent_dim, cfg.kv_lora_rank) if cfg.is_mla else (cfg.head_dim, cfg.head_dim)
  lens, plens = ro.lengths.astype(np.float64), ro.prompt_lens.astype(np.float64)
  ctx_sum = float(np.sum(lens * plens + lens * (lens - 1) / 2 + lens))  # sum_i (plen + i + 1), i < len
  steps = ro.stats["decode_steps"]
  tokens = float(lens.sum())
  t_mem = (w_bytes * steps + ctx_sum * kv_token_bytes) / HBM_BYTES_PER_S
  lin_flops = 2 * tokens * linear_params(cfg)
  attn_flops = 2 * ctx_sum * cfg.n_heads * (k_dim + v_dim) * cfg.n_layers
  t_flop = lin_flops / PEAK_FLOPS["fp8" if weights_fp8 else "bf16"] + attn_flops / PEAK_FLOPS["bf16"]
  return {"weight_bytes_per_step": w_bytes, "kv_bytes_live_context": ctx_sum * kv_token_bytes,
          "kv_bytes_read_by_xla_attention": float(steps) * slots * max_len * kv_token_bytes,
          "t_mem_s": t_mem, "t_flop_s": t_flop, "mem_roofline_fraction": t_mem / max(decode_s, 1e-12),
          "flop_roofline_fraction": t_flop / max(decode_s, 1e-12),
          "decode_step_ms": 1e3 * decode_s / max(steps, 1)}


def length_stats(ro: smp.Rollout, max_new: int) -> dict:
  l = ro.lengths
  return {"mean": float(l.mean()), "p10": float(np.percentile(l, 10)), "p50": float(np.median(l)),
          "p90": float(np.percentile(l, 90)), "max": int(l.max()), "min": int(l.min()),
          "frac_at_max_new": float(np.mean(l == max_new)),
          "frac_stopped": float(np.mean(ro.finish_reason == smp.FINISH_STOP))}


# ------------------------------------------------------------------------------------------------------------------
# fp8jax runs
# ------------------------------------------------------------------------------------------------------------------


_SAMPLERS: dict[str, smp.Sampler] = {}


def get_sampler(a, cfg, name) -> smp.Sampler:
  """One Sampler per config: its jitted prefill (keyed by the Sampler object and shapes) serves both workloads."""
  if name not in _SAMPLERS:
    recipe, kv = recipe_of(a, name), CONFIGS[name][1]
    scfg = smp.SamplerConfig(slots=a.slots, max_len=a.prompt_len + a.max_new, prompt_buckets=(a.prompt_len,),
                             kv_cache=kv, decode_chunk=a.decode_chunk, **SAMPLER_OVERRIDES.get(name, {}))
    cfg = dataclasses.replace(cfg, **MODEL_OVERRIDES.get(name, {}))
    _SAMPLERS[name] = smp.Sampler(cfg, scfg, ops.LinearConfig.from_recipe(recipe))
  return _SAMPLERS[name]


def run_fp8jax(a, cfg, name, params, prompts, workload, kv_scales=None) -> dict:
  recipe, kv = recipe_of(a, name), CONFIGS[name][1]
  max_len = a.prompt_len + a.max_new
  s = get_sampler(a, cfg, name)
  params = s.fuse_projections(params)  # once, as the rollout worker's refit does (generate would do it per call)
  if workload == "uniform":
    sp, n = smp.SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new, seed=a.seed), a.samples
    prompts = prompts[:a.prompts or max(1, a.slots // n)]
  else:
    sp = smp.SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new, seed=a.seed,
                            stop_token_ids=long_tail_stop_ids(cfg.vocab_size, a.max_new, a.seed))
    n, prompts = a.long_tail_samples, prompts[:a.slots]
  t0 = time.perf_counter()
  ro = s.generate(params, prompts, sp, n=n, kv_scales=kv_scales)
  first_s = time.perf_counter() - t0
  if not a.no_warmup:
    ro = s.generate(params, prompts, sp, n=n, kv_scales=kv_scales)
  st = ro.stats
  profile = None
  if a.profile:  # a third call, untimed, with one decode chunk traced
    trace_dir = os.path.join(os.path.dirname(os.path.abspath(a.out or "bench_rollout.json")), f"trace_{name}_{workload}")
    profile = profile_decode_chunk(s, trace_dir, lambda: s.generate(params, prompts, sp, n=n, kv_scales=kv_scales),
                                   chunk=max(1, a.max_new // a.decode_chunk // 2), steps=a.decode_chunk)
  decode_s = st["generate_s"] - st["prefill_s"]
  res = {"config": name, "workload": workload, "requests": len(ro.lengths), "samples_per_prompt": n,
         "first_call_s (compile + run)": first_s, **st, "e2e_tokens_per_s": st["generated_tokens"] / st["generate_s"],
         "lengths": length_stats(ro, a.max_new),
         "roofline": roofline(cfg, ro, weight_bytes_per_step(params, cfg), kv == "fp8", recipe.mode == "fp8", a.slots,
                              max_len, decode_s)}
  # Memory vs copying: every slot holding its whole context in its own pages (its prompt's KV copied in).
  lay = s.layout(len(prompts), a.prompt_len, a.max_new)
  heads, head_dim, values = cfg.kv_cache_layout
  res["kv_cache_bytes_if_copied"] = kvc.cache_bytes(cfg.n_layers, lay.slots * lay.blocks, lay.page, heads, head_dim,
                                                    kv == "fp8", values)
  if profile is not None:
    res["profile"] = profile
  if workload == "long_tail":
    res["n_stop_ids"] = len(sp.stop_token_ids)
  if workload == "uniform" and not np.all(ro.lengths == a.max_new):
    res["warning"] = "uniform workload: some completion did not run to max_new"
  log(f"  {name:6s} {workload:9s} {st['gen_tokens_per_s']:10.1f} tok/s decode, {res['e2e_tokens_per_s']:10.1f} e2e, "
      f"prefill {st['prefill_tokens_per_s']:10.1f} tok/s, occ {st['mean_occupancy']:.3f}, "
      f"step {res['roofline']['decode_step_ms']:.2f} ms, first call {first_s:.1f} s")
  return res


def profile_decode_chunk(sampler, trace_dir: str, run, chunk: int, steps: int, top: int = 30) -> dict:
  """Runs ``run()`` (a generate call on ``sampler``) with decode chunk number ``chunk`` under jax.profiler, and sums
  the trace's device kernels by name: where one decode step's time goes (total / steps per kernel name)."""
  import glob  # noqa: PLC0415
  import gzip  # noqa: PLC0415

  decode = type(sampler)._decode
  calls = [0]

  def traced(*args, **kw):  # the instance attribute shadows the class's jitted method for this one run
    calls[0] += 1
    if calls[0] != chunk:
      return decode(sampler, *args, **kw)
    jax.block_until_ready(args[1].slot_req)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      return jax.block_until_ready(decode(sampler, *args, **kw))

  sampler._decode = traced
  try:
    run()
  finally:
    del sampler._decode
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
  if not files:
    return {"error": f"no perfetto trace under {trace_dir} (chunk {chunk} of {calls[0]} never ran?)"}
  with gzip.open(files[-1]) as f:
    tr = json.load(f)
  events = tr["traceEvents"] if isinstance(tr, dict) else tr
  procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device_pids = {p for p, n in procs.items() if "/device:" in n}
  kernels: dict[str, list] = {}
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in device_pids:
      k = kernels.setdefault(e["name"], [0, 0.0, e.get("args", {})])
      k[0] += 1
      k[1] += float(e.get("dur", 0.0))
  rows = sorted(({"kernel": n, "calls": c, "us_per_step": us / steps, "example_args": {
      k: str(v)[:200] for k, v in args.items()}} for n, (c, us, args) in kernels.items()),
      key=lambda r: -r["us_per_step"])
  total = sum(r["us_per_step"] for r in rows)
  log(f"  profile ({steps} decode steps, chunk {chunk}): {total / 1e3:.2f} ms of device kernels per step; top:")
  for r in rows[:top]:
    log(f"    {r['us_per_step']:9.1f} us/step {100 * r['us_per_step'] / max(total, 1e-9):5.1f}%  x{r['calls']:<6d} "
        f"{r['kernel'][:90]}")
  return {"steps": steps, "chunk": chunk, "device_us_per_step": total, "device_processes": sorted(
      procs[p] for p in device_pids), "kernels": rows[:200], "trace": files[-1]}


# ------------------------------------------------------------------------------------------------------------------
# tunix peer
# ------------------------------------------------------------------------------------------------------------------


class _IdTokenizer:
  """Prompts travel through tunix's string API as space-separated ids; no real vocabulary is needed."""

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(t)) for t in ids)

  def bos_id(self):
    return 0  # falsy: tunix then prepends no BOS

  def eos_id(self):
    return -1

  def pad_id(self):
    return 0


def _tunix_model(cfg: ModelConfig, master):
  """tunix Llama3 with fp8jax's random BF16 weights (HF layout (out, in) -> tunix einsum layouts, as tunix's own
  safetensors mapping does). The module is built abstractly (nnx.eval_shape) and its params are then replaced, so no
  second set of random weights is drawn (the converted copies are tunix's BF16 weights)."""
  from flax import nnx  # noqa: PLC0415
  from tunix.models.llama3 import model as tm  # noqa: PLC0415

  if cfg.qk_norm:
    raise ValueError("tunix Llama3 has no qk_norm")
  tcfg = tm.ModelConfig(num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.dim, hidden_dim=cfg.ffn_dim,
                        num_heads=cfg.n_heads, head_dim=cfg.head_dim, num_kv_heads=cfg.n_kv_heads,
                        rope_theta=int(cfg.rope_theta), norm_eps=cfg.norm_eps, weight_tying=cfg.tie_embeddings)
  model = nnx.eval_shape(lambda: tm.Llama3(tcfg, rngs=nnx.Rngs(params=0)))
  d, hq, hkv, hd = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  bf = jnp.bfloat16
  t = fp8jax.jit(lambda w: w.T.astype(bf))

  def put(var, value):
    old = var.get_value() if hasattr(var, "get_value") else var.value
    if tuple(old.shape) != tuple(value.shape):
      raise ValueError(f"tunix param shape {old.shape} != converted {value.shape}")
    if hasattr(var, "set_value"):
      var.set_value(value)
    else:
      var.value = value

  put(model.embedder.input_embedding, master["embed"].astype(bf))
  put(model.final_norm.w, master["final_norm"].astype(bf))
  if not cfg.tie_embeddings:
    put(model.lm_head.w, t(master["lm_head"]))
  for i, lp in enumerate(master["layers"]):
    tl = model.layers[i]
    put(tl.input_layernorm.w, lp["attn_norm"].astype(bf))
    put(tl.post_attention_layernorm.w, lp["mlp_norm"].astype(bf))
    put(tl.attn.q_proj.w, t(lp["wq"]).reshape(d, hq, hd))
    put(tl.attn.k_proj.w, t(lp["wk"]).reshape(d, hkv, hd))
    put(tl.attn.v_proj.w, t(lp["wv"]).reshape(d, hkv, hd))
    put(tl.attn.o_proj.w, t(lp["wo"]).reshape(hq, hd, d))
    put(tl.mlp.gate_proj.kernel, t(lp["w_gate"]))
    put(tl.mlp.up_proj.kernel, t(lp["w_up"]))
    put(tl.mlp.down_proj.kernel, t(lp["w_down"]))
  abstract = [x for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.ShapeDtypeStruct)]
  if abstract:
    raise ValueError(f"{len(abstract)} tunix Llama3 params were not filled, e.g. {abstract[0]}")
  return model


def run_tunix(a, cfg: ModelConfig, master, prompts) -> dict:
  """The uniform workload through tunix's Sampler (static batch, dense BF16 KV cache), timed end to end."""
  try:
    import tunix  # noqa: PLC0415, F401
    from tunix.generate import sampler as ts  # noqa: PLC0415
  except Exception as e:  # noqa: BLE001 (any import failure: report and continue)
    return {"status": "skipped", "why": f"tunix not importable: {e!r}"}
  try:
    version = package_version("google-tunix")
    # tunix's activation sharding (model.shard) reads the legacy `with mesh:` context; its loaders use an
    # ('fsdp', 'tp') mesh. On one device both axes have size 1.
    # tunix shards with with_sharding_constraint, which needs Auto (not Explicit, the jax 0.11 default) mesh axes.
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with warnings.catch_warnings():  # tunix/flax deprecations (the legacy mesh context among them)
      warnings.simplefilter("ignore", DeprecationWarning)
      with mesh:
        model = _tunix_model(cfg, master)
        sampler = ts.Sampler(model, _IdTokenizer(), ts.CacheConfig(cache_size=a.prompt_len + a.max_new,
                                                                   num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads,
                                                                   head_dim=cfg.head_dim))
        texts = [" ".join(map(str, p)) for p in prompts]
        kw = dict(max_generation_steps=a.max_new, max_prompt_length=a.prompt_len, temperature=a.temperature,
                  top_p=1.0, top_k=None, eos_tokens=[-1], seed=a.seed, return_logprobs=True)
        t0 = time.perf_counter()
        out = sampler(texts, **kw)
        first_s = time.perf_counter() - t0
        if not a.no_warmup:
          t0 = time.perf_counter()
          out = sampler(texts, **kw)
        total_s = time.perf_counter() - t0
    gen = int(sum(len(x) for x in out.tokens))
    res = {"status": "ok", "version": version, "workload": "uniform", "requests": len(texts),
           "generated_tokens": gen, "generate_s": total_s, "e2e_tokens_per_s": gen / total_s,
           "first_call_s (compile + run)": first_s,
           "notes": "tunix.generate.sampler.Sampler + tunix.models.llama3.Llama3, static batch, dense BF16 KV cache, "
                    "left-padded prompts, categorical sampling (top_p=1), return_logprobs=True; timed end to end "
                    "(prefill, decode, host detokenization with an id tokenizer)"}
    log(f"  tunix  uniform   {res['e2e_tokens_per_s']:10.1f} tok/s e2e ({gen} tokens in {total_s:.2f} s), "
        f"first call {first_s:.1f} s")
    return res
  except Exception as e:  # noqa: BLE001 (the peer must never sink the fp8jax results)
    return {"status": "failed", "why": repr(e), "traceback": traceback.format_exc()[-4000:]}


# ------------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------------


def print_table(results: list[dict], tunix_res: dict):
  base = {r["workload"]: r["gen_tokens_per_s"] for r in results if r["config"] == "bf16"}
  hdr = (f"{'config':8s} {'workload':10s} {'tok/s':>10s} {'e2e tok/s':>10s} {'vs bf16':>8s} {'mem roof':>9s} "
         f"{'flop roof':>9s} {'prefill/s':>11s} {'occ':>6s} {'occ bound':>9s} {'step ms':>8s} {'mean len':>9s}")
  log("\n" + hdr + "\n" + "-" * len(hdr))
  for r in results:
    ratio = r["gen_tokens_per_s"] / base[r["workload"]] if r["workload"] in base else float("nan")
    rf = r["roofline"]
    log(f"{r['config']:8s} {r['workload']:10s} {r['gen_tokens_per_s']:10.1f} {r['e2e_tokens_per_s']:10.1f} "
        f"{ratio:8.3f} {rf['mem_roofline_fraction']:9.3f} {rf['flop_roofline_fraction']:9.3f} "
        f"{r['prefill_tokens_per_s']:11.1f} {r['mean_occupancy']:6.3f} {r.get('occupancy_bound', float('nan')):9.3f} "
        f"{rf['decode_step_ms']:8.2f} "
        f"{r['lengths']['mean']:9.1f}")
  if tunix_res.get("status") == "ok":
    log(f"{'tunix':8s} {'uniform':10s} {'-':>10s} {tunix_res['e2e_tokens_per_s']:10.1f}")
    for r in results:
      if r["workload"] == "uniform":
        ratio = r["e2e_tokens_per_s"] / tunix_res["e2e_tokens_per_s"]
        log(f"  fp8jax {r['config']} / tunix (e2e, uniform): {ratio:.3f}")
  else:
    log(f"tunix: {tunix_res.get('status')}: {tunix_res.get('why')}")


def main(argv=None):
  a = parse_args(argv)
  cfg = model_config(a)
  meta = {**provenance(), "preset": a.preset,
          "args": {k: v for k, v in vars(a).items()}, "model": dataclasses.asdict(cfg),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "xla_python_client_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
          "reference_xla_parts": "RoPE, norms, sampling, KV write; BF16 GEMMs are XLA dots; FP8 GEMM and "
                                 "attention: see gemm_backends",
          "roofline": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "peak_flops": PEAK_FLOPS}}
  log(f"bench_rollout: {meta['device']} jax {jax.__version__}, preset {a.preset}: {cfg.n_layers} layers, "
      f"dim {cfg.dim}, vocab {cfg.vocab_size}; slots {a.slots}, prompt {a.prompt_len}, max_new {a.max_new}")
  prompts = make_prompts(max(a.slots, a.prompts or 0), a.prompt_len, cfg.vocab_size, a.seed)
  out = {"meta": meta, "fp8jax": [], "tunix": {"status": "not run yet"}}
  t_start = time.perf_counter()
  last_run_s = [0.0]

  def over_budget(what: str) -> bool:
    """Skips a run that would likely end past --budget_s (elapsed + the previous run's duration)."""
    elapsed = time.perf_counter() - t_start
    if elapsed + last_run_s[0] > a.budget_s:
      log(f"  skip {what}: {elapsed:.0f} s elapsed + ~{last_run_s[0]:.0f} s > --budget_s {a.budget_s:.0f}")
      out.setdefault("skipped", []).append(what)
      save(a, out)
      return True
    return False

  def timed(fn, *args):
    t0 = time.perf_counter()
    r = fn(*args)
    last_run_s[0] = time.perf_counter() - t0
    return r

  t0 = time.perf_counter()
  master = llama.init_params(cfg, seed=a.seed, dtype=jnp.bfloat16)
  jax.block_until_ready(master)
  log(f"random BF16 weights: {time.perf_counter() - t0:.1f} s")
  # the sampling weights by recipe mode (kv_cache and the backends leave them alone)
  params = {"bf16": smp.prepare_params(master, CONFIGS["bf16"][0])}  # BF16 weights alias the master's buffers
  if any(CONFIGS[c][0].mode == "fp8" for c in a.configs):
    t0 = time.perf_counter()
    params["fp8"] = smp.prepare_params(master, recipe_of(a, next(c for c in a.configs if CONFIGS[c][0].mode == "fp8")))
    jax.block_until_ready(params["fp8"])
    log(f"quantize_params: {time.perf_counter() - t0:.1f} s")
  kv_scales = None
  fp8_kv = [c for c in a.configs if CONFIGS[c][1] == "fp8"]
  if fp8_kv:
    t0 = time.perf_counter()
    kv_scales = get_sampler(a, cfg, fp8_kv[0]).calibrate_kv_scales(params["fp8"], prompts[:8], margin=a.kv_margin)
    log(f"KV scales calibrated on 8 prompts ({time.perf_counter() - t0:.1f} s): K {np.asarray(kv_scales[0])[:4]}.., "
        f"V {np.asarray(kv_scales[1])[:4]}..")
  # Headline runs first (uniform, then the tunix peer), then the long tail: a budget cut drops the least important.
  order = [(c, w) for w in a.workloads for c in a.configs]
  order.sort(key=lambda cw: cw[1] != "uniform")
  n_uniform = sum(w == "uniform" for _, w in order)
  for i in range(len(order) + 1):
    if i == n_uniform:  # the peer, after fp8jax's uniform runs
      if a.no_tunix:
        out["tunix"] = {"status": "skipped", "why": "--no_tunix"}
      elif a.model_config:
        out["tunix"] = {"status": "skipped", "why": f"tunix peer is Llama only; --model_config={a.model_config}"}
      elif not over_budget("tunix"):
        out["tunix"] = timed(run_tunix, a, cfg, master, prompts[:a.slots])
        if out["tunix"]["status"] != "ok":
          log(f"tunix peer {out['tunix']['status']}: {out['tunix']['why']}")
      save(a, out)
    if i == len(order):
      break
    name, w = order[i]
    if over_budget(f"{name}/{w}"):
      continue
    out["fp8jax"].append(timed(run_fp8jax, a, cfg, name, params[CONFIGS[name][0].mode], prompts, w,
                               kv_scales if CONFIGS[name][1] == "fp8" else None))
    save(a, out)
    free_unneeded(name, params, order[i + 1:])
  meta["gemm_backends"] = backends.backend_report()
  log(f"GEMM backends (backends.backend_report): {meta['gemm_backends']}")
  print_table(out["fp8jax"], out["tunix"])
  meta["total_s"] = time.perf_counter() - t_start
  save(a, out)
  if a.out:
    log(f"wrote {a.out} ({meta['total_s']:.0f} s)")
  return out


def free_unneeded(name, params, rest):
  """Drops what no later run in ``rest`` uses: the config's sampler (with the compiled programs that hold it, as their
  static argument) and the FP8 weights. An 80 GB card cannot hold the FP8 run's leftovers beside BF16's KV pool:
  on an H100 the BF16 run after FP8 + FP8 KV found 38.7 GB free for a 37.9 GB pool (2026-12-07)."""
  if all(c != name for c, _ in rest) and _SAMPLERS.pop(name, None) is not None:
    jax.clear_caches()
  mode = CONFIGS[name][0].mode
  if mode != "bf16" and all(CONFIGS[c][0].mode != mode for c, _ in rest):  # BF16 weights alias the master
    params.pop(mode, None)
  gc.collect()


def save(a, out):
  """Rewrites the JSON after every run, so a run cut short still leaves its results."""
  if not a.out:
    return
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out + ".tmp", "w") as f:
    json.dump(out, f, indent=1, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))
  os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
  main()
