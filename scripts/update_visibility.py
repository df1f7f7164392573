"""How much of a run's first optimizer steps can show in the weights the policy runs with, BF16 vs block FP8.

A pretrained BF16 checkpoint loaded into FP32 master weights puts every master weight exactly on the BF16 grid. An
update moves the BF16 copy (the BF16 recipe's sampler and trainer weights) only once the master has moved half a BF16
spacing (2^-8 relative) away; the block-FP8 codes (``fp8jax.quant.quantize_weight``, 128x128 blocks, scale amax/448) sit
on a grid the checkpoint is not aligned with, so each small update moves the codes of the weights that happen to lie
near a rounding boundary. This script measures both on a checkpoint's linear weights: the master moved by the cumulative
learning rate after k steps (what k Adam steps of one sign do at most: each moves a weight by ~lr) in a random
direction per weight, the share of weights whose BF16 value / dequantized FP8 weight changed (for FP8 also the share
of E4M3 codes that changed: the other changes are a block scale that moved with its block's largest weight), and
the share of the update that arrived: sum(change * direction) / (move * size), ~1 where the update shows in full
(in expectation), ~0 where the grid swallows it.

  python scripts/update_visibility.py --hf_dir smollm2-135m-instruct --lr 2e-6 --warmup 10 \\
      --out docs/results/update_visibility_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8jax  # noqa: E402

fp8jax.configure_xla()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax import assets, quant  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402


def _moves(w, delta, key):
  """``w`` (FP32 master weights on the BF16 grid) moved by ``delta`` in a random direction per weight (an Adam
  step's shape: +-lr per weight) -> for the BF16 copy and for the block-FP8 weights (dequantized): the share of weights
  whose value changed and the share of the update that arrived, sum((new - old) * direction) / (delta * size)
  (1: the update shows in full, in expectation; 0: nothing of it shows)."""
  sign = jnp.where(jax.random.bernoulli(key, 0.5, w.shape), 1.0, -1.0)
  ws = w + delta * sign
  bf_d = ws.astype(jnp.bfloat16).astype(jnp.float32) - w.astype(jnp.bfloat16).astype(jnp.float32)
  q0, q1 = quant.quantize_weight(w), quant.quantize_weight(ws)
  f8_d = quant.dequantize_weight(q1) - quant.dequantize_weight(q0)
  codes = jnp.sum(q1.q.astype(jnp.float32) != q0.q.astype(jnp.float32))  # the rest of f8_d: block scales that moved
  return (jnp.sum(bf_d != 0), jnp.sum(bf_d * sign) / delta, jnp.sum(f8_d != 0), jnp.sum(f8_d * sign) / delta,
          codes)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--hf_dir", required=True, help="an HF directory, or a pinned model's name (get_model.py --list)")
  ap.add_argument("--lr", type=float, default=2e-6)
  ap.add_argument("--warmup", type=int, default=10, help="linear warmup steps (optim.warmup_steps)")
  ap.add_argument("--steps", default="1,5,10,20,50,100")
  ap.add_argument("--out", default="")
  a = ap.parse_args(argv)
  from safetensors.numpy import load_file  # noqa: PLC0415

  hf_dir = assets.resolve_model_dir(a.hf_dir, "--hf_dir")
  tensors = {}
  for f in sorted(os.listdir(hf_dir)):
    if f.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(hf_dir, f)))
  names = [k for k, v in tensors.items() if v.ndim == 2 and "embed" not in k and "lm_head" not in k]
  if not names:
    sys.exit(f"{hf_dir}: no 2-D linear weights in its safetensors")
  steps = [int(s) for s in a.steps.split(",")]
  cum = {k: sum(a.lr * min(s, a.warmup) / max(a.warmup, 1) for s in range(1, k + 1)) for k in steps}
  moves = jax.jit(_moves)
  tot = {k: np.zeros(5) for k in steps}
  n = 0
  for i, name in enumerate(names):
    w = jnp.asarray(tensors[name], jnp.float32)
    n += w.size
    for k in steps:  # directions drawn per matrix and per step count
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), i), k)
      tot[k] += np.asarray([float(x) for x in moves(w, cum[k], key)])
  rows = [{"steps": k, "cum_lr": cum[k], "bf16_changed_frac": t[0] / n, "bf16_update_arrived": t[1] / n,
           "fp8_changed_frac": t[2] / n, "fp8_update_arrived": t[3] / n, "fp8_codes_changed_frac": t[4] / n}
          for k, t in tot.items()]
  print(f"{hf_dir}: {len(names)} linear weights, {n:,} values; lr {a.lr:g}, warmup {a.warmup}")
  print(f"{'steps':>5s} {'cum lr':>9s} {'BF16 changed':>12s} {'BF16 arrived':>12s} {'FP8 changed':>11s} "
        f"{'FP8 codes':>10s} {'FP8 arrived':>11s}")
  for r in rows:
    print(f"{r['steps']:5d} {r['cum_lr']:9.2e} {100 * r['bf16_changed_frac']:11.2f}% {r['bf16_update_arrived']:12.3f} "
          f"{100 * r['fp8_changed_frac']:10.2f}% {100 * r['fp8_codes_changed_frac']:9.2f}% "
          f"{r['fp8_update_arrived']:11.3f}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({**provenance(" ".join(["python", "scripts/update_visibility.py", *(argv or sys.argv[1:])])),
                 "hf_dir": os.path.basename(os.path.normpath(hf_dir)),
                 "lr": a.lr, "warmup": a.warmup, "values": n, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
