"""Sampler vs trainer on the same tokens: are the rollout log-probs the trainer's own?

  python scripts/check_one_engine.py [--dim 1024 --layers 4 --vocab 32768 --slots 64 --max_new 128]

Random weights; for each recipe (BF16; FP8; FP8 + FP8 KV cache) ``fp8jax.one_engine.sampler_vs_trainer`` samples
completions with the jitted sampler, recomputes the log-probs with the trainer's forward (FP8Weight master params,
same K/V quantization), and this prints token_mult_prob_error, max |dlp| and the fraction of tokens whose log-probs
are bitwise equal. On CPU the FP8 GEMMs
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
import numpy as np  # noqa: E402

from fp8jax import backends, one_engine  # noqa: E402


def main():
  ap = one_engine.add_model_args(argparse.ArgumentParser())
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=2)
  ap.add_argument("--max_new", type=int, default=32)
  a = ap.parse_args()
  cfg = one_engine.model_config(a.dim, a.layers, a.vocab)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, a.vocab, size=int(rng.integers(8, 48))).tolist() for _ in range(a.prompts)]
  rows = {name: one_engine.sampler_vs_trainer(cfg, r, prompts, slots=a.slots, samples=a.samples, max_new=a.max_new)
          for name, r in one_engine.promised_recipes(a.quantize_lm_head).items()}
  print(f"device: {jax.devices()[0].device_kind}; GEMM backends: {backends.backend_report()}")
  print(f"{'recipe':8s} {'tokens':>7s} {'token_mult_prob_error':>22s} {'max|dlp|':>10s} {'bitwise equal':>14s}")
  for name, m in rows.items():
    print(f"{name:8s} {m['tokens']:7d} {m['token_mult_prob_error']:22.9f} {m['max_abs_logp_diff']:10.2e} "
          f"{m['bitwise_equal_frac']:14.4f}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
