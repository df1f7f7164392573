"""Is the forward pass under ``jax.value_and_grad`` bitwise the plain forward? (the BF16 arm's off-policy train step)

  PYTHONPATH=. python3 scripts/check_grad_forward.py [--config=configs/smollm2_asdiv_fp8.py] [--modes=bf16,fp8]
      [--layers=1,2,0] [--rows=8 --seq=640] [--linear] [--set key=value ...] [--out=FILE.json]

The trainer's train step differentiates the same log-prob function that its log-prob pass (and the sampler)
computes; if XLA compiles the forward half of the gradient program differently, the PPO ratio of a fresh rollout is
not exactly 1. For each recipe (--modes) and depth (--layers; 0 = the config's), the config's model with random
weights (``init_params``, seed 0) scores --rows random sequences of --seq tokens twice: ``learner.logprobs`` (the
log-prob pass) and the auxiliary output of ``jax.value_and_grad`` of a random linear functional of the same
log-probs. Printed: the fraction of log-probs that are bitwise equal and the largest difference. --linear first
checks ``fp8jax.ops.linear`` alone at each of the model's linear shapes (and the head's, FP32 out) in BF16 mode,
--rows x --seq rows: plain output vs the primal of ``value_and_grad`` and of ``jax.vjp``. --set overrides config
keys (e.g. ``fp8.gemm_backend=xla``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax import ops  # noqa: E402
from fp8jax.config_utils import load_config_file, override, parse_sets  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402
from fp8jax.model import llama, schema  # noqa: E402
from fp8jax.model.config import ModelConfig  # noqa: E402
from fp8jax.rl import trainer as trainer_lib  # noqa: E402


def check_linear(cfg, backend: str, rows: int) -> list[dict]:
  """ops.linear alone (BF16 mode) at the model's linear shapes: plain vs under value_and_grad / vjp."""
  rng = np.random.default_rng(0)
  linear = {p.key for p in schema.LAYER if p.linear}
  shapes = sorted({s for key, s in schema.layer_shapes(cfg, 0).items() if key in linear and len(s) == 2})
  cases = [(n, k, "bfloat16") for n, k in shapes] + [(min(cfg.vocab_size, 8192), cfg.dim, "float32")]
  out = []
  for n, k, out_dtype in cases:
    lcfg = ops.LinearConfig(backend=backend, out_dtype=out_dtype)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    c = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)

    def loss(x, w, c, lcfg=lcfg):
      y = ops.linear(x, w, lcfg)
      return jnp.sum(y.astype(jnp.float32) * c), y

    plain = fp8jax.jit(lambda x, w, lcfg=lcfg: ops.linear(x, w, lcfg))(x, w)
    (_, under_grad), _ = fp8jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w, c)
    under_vjp, _ = fp8jax.jit(lambda x, w, lcfg=lcfg: jax.vjp(lambda x, w: ops.linear(x, w, lcfg), x, w))(x, w)
    a, b, v = (np.asarray(t, np.float32) for t in (plain, under_grad, under_vjp))
    out.append(dict(n=n, k=k, out_dtype=out_dtype, grad_bitwise=float(np.mean(a == b)),
                    vjp_bitwise=float(np.mean(a == v)), max_abs_diff=float(np.abs(a - b).max())))
  return out


def check_model(config: str, mode: str, layers: int, rows: int, seq: int, sets: dict) -> dict:
  ov = {"fp8.mode": mode, "checkpoint.hf_dir": "", **sets}
  if mode == "bf16":
    ov.setdefault("fp8.kv_cache", "bf16")
  if layers:
    ov["model.n_layers"] = layers
  c = override(load_config_file(config), ov, "check_grad_forward")
  learner = trainer_lib.learner_from_config(c, jax.devices()[:1])
  params = llama.init_params(learner.cfg, seed=0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, learner.cfg.vocab_size, (rows, seq)), jnp.int32)
  coef = jnp.asarray(np.random.default_rng(1).standard_normal((rows, seq - 1)), jnp.float32)
  plain = np.asarray(learner.logprobs(params, tokens)[0])

  def loss(p):
    lp = learner.policy.logprobs(p, tokens)[0]
    return jnp.sum(lp * coef), lp

  (_, under_grad), _ = fp8jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  under_grad = np.asarray(under_grad)
  return dict(mode=mode, layers=learner.cfg.n_layers, remat=bool(learner.cfg.remat),
              bitwise=float(np.mean(plain == under_grad)), max_abs_diff=float(np.abs(plain - under_grad).max()))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/smollm2_asdiv_fp8.py")
  ap.add_argument("--modes", default="bf16,fp8")
  ap.add_argument("--layers", default="1,2,0", help="model depths; 0 = the config's")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--seq", type=int, default=640)
  ap.add_argument("--linear", action="store_true", help="first check ops.linear alone at the model's shapes")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  ap.add_argument("--out", default="")
  a = ap.parse_args(argv)
  try:
    sets = parse_sets(a.set)
  except ValueError as e:
    ap.error(str(e))
  result = {**provenance(), "linear": [], "model": []}
  if a.linear:
    cfg = ModelConfig.from_config(override(load_config_file(a.config), sets, "check_grad_forward").model)
    backend = sets.get("fp8.gemm_backend", "auto")
    result["linear"] = check_linear(cfg, backend, a.rows * a.seq)
    for r in result["linear"]:
      print(f"linear N={r['n']} K={r['k']} out={r['out_dtype']}: under value_and_grad bitwise {r['grad_bitwise']:.4f}"
            f", under vjp {r['vjp_bitwise']:.4f}, max |diff| {r['max_abs_diff']:.3g}", flush=True)
  print("| recipe | layers | remat | log-probs bitwise (grad vs plain) | max abs diff |\n|---|---|---|---|---|")
  for mode in a.modes.split(","):
    for layers in (int(x) for x in a.layers.split(",")):
      r = check_model(a.config, mode, layers, a.rows, a.seq, sets)
      result["model"].append(r)
      row = (r["mode"], r["layers"], r["remat"], f"{r['bitwise']:.4f}", f"{r['max_abs_diff']:.3g}")
      print("| " + " | ".join(map(str, row)) + " |", flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
