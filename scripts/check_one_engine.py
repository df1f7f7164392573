"""Sampler vs trainer on the same tokens: are the rollout log-probs the trainer's own?

  python scripts/check_one_engine.py [--dim 1024 --layers 4 --vocab 32768 --slots 64 --max_new 128]
  python scripts/check_one_engine.py --hf_dir smollm2-135m-instruct --data gsm8k:test --bucket 384 --max_new 256

Random weights, or with --hf_dir a real model on chat-formatted problems of a real data set (sampling stops at the
model's EOS ids, as in training); for each recipe (BF16; FP8; FP8 + FP8 KV cache) ``fp8jax.diagnostics.one_engine.sampler_vs_trainer``
samples completions with the jitted sampler, recomputes the log-probs with the trainer's forward (FP8Weight master
params, same K/V quantization), and this prints token_mult_prob_error, max |dlp| and the fraction of tokens whose
log-probs are bitwise equal. On CPU the FP8 GEMMs
are the XLA reference; on an sm_90 GPU, the Pallas kernel (the GEMM backend is printed). --quantize_lm_head moves the
FP8 recipes' output head onto the FP8 GEMM too, which isolates the BF16 head GEMM as a cause of mismatch.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax import backends  # noqa: E402
from fp8jax.diagnostics import one_engine  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402


def real_model(a):
  """The model, its master params, chat-formatted prompts of a real data set and the model's EOS ids."""
  from fp8jax import assets, hf  # noqa: PLC0415
  from fp8jax.rl import data, evaluate  # noqa: PLC0415

  hf_dir = assets.resolve_model_dir(a.hf_dir, "--hf_dir")
  cfg = hf.load_config(hf_dir, max_seq_len=a.bucket + a.max_new)
  master = hf.load_params(hf_dir, cfg)
  tok = hf.Tokenizer(hf_dir)
  examples = data.load_prompts(assets.resolve_data_file(a.data, "--data"), template=a.template,
                               max_examples=a.prompts)
  prompts = [evaluate.chat_prompt_ids(tok, e.prompt) for e in examples]
  too_long = [len(p) for p in prompts if len(p) > a.bucket]
  if too_long:
    raise SystemExit(f"--bucket={a.bucket}: {len(too_long)} prompts are longer (up to {max(too_long)} tokens)")
  return cfg, master, prompts, tuple(tok.eos_ids)


def main():
  ap = one_engine.add_model_args(argparse.ArgumentParser())
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=2)
  ap.add_argument("--max_new", type=int, default=32)
  ap.add_argument("--hf_dir", default="", help="a real model instead of random weights: an HF directory or a pinned "
                  "model name (scripts/get_model.py --list, e.g. smollm2-135m-instruct)")
  ap.add_argument("--data", default="gsm8k:test", help="with --hf_dir: the prompts, a jsonl file or NAME:SPLIT of a "
                  "pinned data set (scripts/get_data.py --list), in the model's chat template")
  ap.add_argument("--template", default="{prompt}\nPlease reason step by step, and put your final answer within "
                  "\\boxed{}.", help="with --hf_dir: the instruction around each problem ({prompt})")
  ap.add_argument("--bucket", type=int, default=64, help="prompt length bucket (tokens); a real prompt must fit")
  a = ap.parse_args()
  if a.hf_dir:
    cfg, master, prompts, eos = real_model(a)
  else:
    cfg, master, eos = one_engine.model_config(a.dim, a.layers, a.vocab), None, ()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, a.vocab, size=int(rng.integers(8, 48))).tolist() for _ in range(a.prompts)]
  rows = {name: one_engine.sampler_vs_trainer(cfg, r, prompts, slots=a.slots, samples=a.samples, max_new=a.max_new,
                                              bucket=a.bucket, master=master, stop_token_ids=eos)
          for name, r in one_engine.promised_recipes(a.quantize_lm_head).items()}
  print(f"device: {jax.devices()[0].device_kind}; GEMM backends: {backends.backend_report()}")
  print(f"{'recipe':8s} {'tokens':>7s} {'token_mult_prob_error':>22s} {'max|dlp|':>10s} {'bitwise equal':>14s}")
  for name, m in rows.items():
    print(f"{name:8s} {m['tokens']:7d} {m['token_mult_prob_error']:22.9f} {m['max_abs_logp_diff']:10.2e} "
          f"{m['bitwise_equal_frac']:14.4f}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({**provenance(), "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
