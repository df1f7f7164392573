"""Are reruns of the same sampling program bitwise repeatable across processes, one after another and at once?

  PYTHONPATH=. python3 scripts/check_sampler_repeat.py [--config=configs/smollm2_asdiv_fp8.py] [--recipe=fp8+kv]
      [--layers=0] [--new_tokens=96]

The same FP8 (+ FP8 KV) or BF16 sampling program (the model shape of --config, SmolLM2-135M's by default, --layers
deep, 0 = the config's; random weights, std 0.05; 64 random prompts of 100 tokens, 2 samples each at temperature
0.7, seed 1) runs in four child processes of this script: two one after the other, then two at the same time on the same
device. Printed: for each pair compared, the fraction of equal tokens and of bitwise-equal log-probs. A GPU run that
is not repeatable here makes two training runs of one command diverge.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample(out: str, config: str, recipe_name: str, layers: int, new_tokens: int):
  """One run of the sampling program; its tokens and log-probs saved to ``out`` (.npz)."""
  sys.path.insert(0, REPO)
  import fp8jax  # noqa: PLC0415

  fp8jax.configure_xla()
  from fp8jax import ops, sampler  # noqa: PLC0415
  from fp8jax.config_utils import load_config_file  # noqa: PLC0415
  from fp8jax.diagnostics import one_engine  # noqa: PLC0415
  from fp8jax.model.config import ModelConfig  # noqa: PLC0415
  from fp8jax.model.llama import init_params  # noqa: PLC0415

  recipe = one_engine.promised_recipes()[recipe_name]
  cfg = ModelConfig.from_config(load_config_file(config).model)
  if layers:
    cfg = dataclasses.replace(cfg, n_layers=layers)
  prompts = [list(map(int, r)) for r in np.random.default_rng(0).integers(3, 49000, (64, 100))]
  s = sampler.Sampler(cfg, sampler.SamplerConfig(slots=64, max_len=128 + new_tokens, prompt_buckets=(128,),
                                                 kv_cache=recipe.kv_cache), ops.LinearConfig.from_recipe(recipe))
  p = sampler.prepare_params(init_params(cfg, seed=0, std=0.05), recipe)
  kv = s.calibrate_kv_scales(p, prompts, 1.25) if recipe.kv_cache == "fp8" else None
  ro = s.generate(p, prompts, sampler.SamplingParams(max_new_tokens=new_tokens, seed=1, temperature=0.7), n=2,
                  kv_scales=kv)
  np.savez(out, tokens=np.asarray(ro.tokens), logprobs=np.asarray(ro.logprobs))


def compare(a: str, b: str) -> str:
  x, y = np.load(a), np.load(b)
  return (f"tokens equal {np.mean(x['tokens'] == y['tokens']):.4f}, "
          f"log-probs bitwise {np.mean(x['logprobs'] == y['logprobs']):.4f}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/smollm2_asdiv_fp8.py", help="the model shape (random weights)")
  ap.add_argument("--recipe", default="fp8+kv", help="a key of fp8jax.diagnostics.one_engine.promised_recipes()")
  ap.add_argument("--layers", type=int, default=0, help="model depth; 0 = the config's")
  ap.add_argument("--new_tokens", type=int, default=96)
  ap.add_argument("--child", default="", help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.child:
    return sample(a.child, a.config, a.recipe, a.layers, a.new_tokens)
  with tempfile.TemporaryDirectory() as d:
    runs = [os.path.join(d, f"run{i}.npz") for i in range(4)]
    cmd = [sys.executable, os.path.abspath(__file__), f"--config={a.config}", f"--recipe={a.recipe}",
           f"--layers={a.layers}", f"--new_tokens={a.new_tokens}"]

    def start(out):
      return subprocess.Popen(cmd + [f"--child={out}"], cwd=REPO)

    for out in runs[:2]:  # one after the other
      if start(out).wait():
        sys.exit(f"the run writing {out} failed")
    together = [start(out) for out in runs[2:]]  # at the same time
    if any(p.wait() for p in together):
      sys.exit("a concurrent run failed")
    for (i, j), what in (((0, 1), "sequential"), ((0, 2), "sequential vs concurrent"), ((2, 3), "concurrent")):
      print(f"{what} (run {i} vs run {j}): {compare(runs[i], runs[j])}")


if __name__ == "__main__":
  main()
