"""Sampler vs trainer on the same tokens: are the rollout log-probs the trainer's own?

  python scripts/check_one_engine.py [--dim 1024 --layers 4 --vocab 32768 --slots 64 --max_new 128]

Random weights; for each recipe (BF16; FP8; FP8 + FP8 KV cache) it samples completions with the jitted sampler,
recomputes the log-probs with the trainer's forward (FP8Weight master params, same K/V quantization), and prints
token_mult_prob_error, max |dlp| and the fraction of tokens whose log-probs are bitwise equal. On CPU the FP8 GEMMs
are the XLA reference; on an sm_90 GPU, the Pallas kernel (the GEMM backend is printed). --quantize_lm_head moves the
FP8 recipes' output head onto the FP8 GEMM too, which isolates the BF16 head GEMM as a cause of mismatch.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax import ops, quant, sampler  # noqa: E402
from fp8jax.model import ModelConfig, init_params  # noqa: E402
from fp8jax.rl import grpo  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=2)
  ap.add_argument("--max_new", type=int, default=32)
  ap.add_argument("--quantize_lm_head", action="store_true",
                  help="FP8 recipes put the output head on the (batch-invariant) FP8 GEMM too")
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  hd = 128
  cfg = ModelConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.dim // hd, n_kv_heads=max(1, a.dim // hd // 4),
                    head_dim=hd, ffn_dim=int(a.dim * 3.5) // 128 * 128, max_seq_len=4096)
  master = init_params(cfg, seed=0, std=0.05)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, a.vocab, size=int(rng.integers(8, 48))).tolist() for _ in range(a.prompts)]
  rows = {}
  head = a.quantize_lm_head
  for name, recipe in (("bf16", quant.Recipe(mode="bf16")), ("fp8", quant.Recipe(quantize_lm_head=head)),
                       ("fp8+kv", quant.Recipe(kv_cache="fp8", quantize_lm_head=head))):
    lcfg = ops.LinearConfig.from_recipe(recipe)
    sc = sampler.SamplerConfig(slots=a.slots, max_len=64 + a.max_new, prompt_buckets=(64,), kv_cache=recipe.kv_cache)
    s = sampler.Sampler(cfg, sc, lcfg)
    sp_params = sampler.prepare_params(master, recipe)
    kv = s.calibrate_kv_scales(sp_params, prompts, 1.25) if recipe.kv_cache == "fp8" else None
    ro = s.generate(sp_params, prompts, sampler.SamplingParams(max_new_tokens=a.max_new, seed=1), n=a.samples,
                    kv_scales=kv)
    seq, mask, gen_lp = ro.sequences()
    trainer_lp = fp8jax.jit(lambda p, t: sampler.trainer_logprobs(quant.mark_fp8(p, recipe), t, cfg, lcfg,
                                                                  kv_scales=kv))(master, jnp.asarray(seq))
    m = {k: float(v) for k, v in grpo.mismatch_metrics(jnp.asarray(gen_lp), trainer_lp, jnp.asarray(mask)).items()}
    sel = mask > 0
    m["bitwise_equal_frac"] = float(np.mean(np.asarray(trainer_lp)[sel] == gen_lp[sel]))
    m["tokens"] = int(sel.sum())
    rows[name] = m
  print(f"device: {jax.devices()[0].device_kind}; GEMM backends: {ops.backend_report()}")
  print(f"{'recipe':8s} {'tokens':>7s} {'token_mult_prob_error':>22s} {'max|dlp|':>10s} {'bitwise equal':>14s}")
  for name, m in rows.items():
    print(f"{name:8s} {m['tokens']:7d} {m['token_mult_prob_error']:22.9f} {m['max_abs_logp_diff']:10.2e} "
          f"{m['bitwise_equal_frac']:14.4f}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
