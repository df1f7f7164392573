"""GRPO step time at a recipe's full width and a reduced depth: several recipes side by side in one process.

  python scripts/bench_grpo_step.py --configs configs/qwen3_30b_a3b_fp8.py,configs/qwen3_30b_a3b_bf16.py \
      --layers 2 --steps 5 --out grpo_step_qwen3_30b_smoke.json

Each config is built at the GRPO smoke's shape (``config_utils.smoke_shape``: random weights, 16 prompts x 8 samples
of the embedded arithmetic task, 64-token sequences, 16 new tokens, microbatch 32, KL off) and runs ``--steps`` RL
steps through ``RLTrainer.step`` (refit/requantization, rollout, rewards, batch, the learner's passes and update; no
validation or checkpoint). Step 1 compiles; the table reports the median of the later steps (step, rollout, train,
requantization seconds), generated tokens/s, token_mult_prob_error (sampler vs trainer) and the process's peak
memory so far on its busiest device (the first config's is its own; a later one's includes the earlier), then each recipe's step
time divided by the first config's (> 1: slower than the first). Rewards are 0 (random weights): this measures the machinery,
not learning.

``--set KEY=VALUE`` (repeatable) changes the smoke shape after it is applied, for every config alike, e.g. a
training-like size: ``--set grpo.num_prompts=32 --set grpo.num_generations=16 --set rollout.max_new_tokens=256
--set rollout.max_len=384 --set grpo.microbatch=64`` (values are Python literals, else strings; a key the config does
not have is refused: ``config_utils.override``).
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax.config_utils import load_config_file, override, parse_sets, smoke_shape  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402
from fp8jax.rl.trainer import RLTrainer  # noqa: E402

KEYS = ("step_s", "rollout_s", "train_s", "requant_s", "gen_tokens_per_s", "token_mult_prob_error")


def peak_gib() -> float | None:
  """The largest peak of this process's devices (GiB; None where the backend keeps no memory stats: CPU)."""
  peaks = [s["peak_bytes_in_use"] for s in (d.memory_stats() or {} for d in jax.local_devices())
           if "peak_bytes_in_use" in s]
  return max(peaks) / 2**30 if peaks else None


def run_config(path: str, a) -> dict:
  c = override(smoke_shape(load_config_file(path), a.layers, a.slots), parse_sets(a.set), "--set")
  t0 = time.perf_counter()
  tr = RLTrainer(c, tempfile.mkdtemp())
  # the build (weights, the memory plan's compiles on a GPU) apart from the steps, printed at once: a run stopped by a
  # time limit still says where its time went
  print(json.dumps({"config": path, "built_s": time.perf_counter() - t0,
                    "plan_compile_s": tr.memory_plan.compile_s}), flush=True)
  rows = []
  for step in range(a.steps):
    launched = tr.launch(step)  # the rollout is done when this returns: its seconds print before the update's
    print(json.dumps({"config": path, "step": step + 1, "rollout_done_s": time.perf_counter() - t0,
                      **{k: float(launched.host[k]) for k in ("requant_s", "rollout_s") if k in launched.host}}),
          flush=True)
    m = tr.finish(launched)
    rows.append({k: float(m[k]) for k in KEYS if k in m})
    print(json.dumps({"config": path, "step": step + 1, **rows[-1]}), flush=True)
  steady = rows[1:] or rows
  plan = tr.memory_plan  # the trainer's own (on a GPU: with the compiled programs' temporaries), beside the peak
  out = {"config": path, "mode": c.fp8.mode, "kv_cache": c.fp8.kv_cache, "lora_rank": int(c.get("lora", {}).get(
             "rank", 0)), "build_and_run_s": time.perf_counter() - t0,
         "rows": rows, "median": {k: float(np.median([r[k] for r in steady if k in r])) for k in KEYS},
         "peak_gib": peak_gib(), "plan_peak_gib": plan.peak() / 2**30, "plan": plan.to_json()}
  del tr
  gc.collect()
  jax.clear_caches()
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--configs", required=True, help="comma-separated configs/*.py; ratios are relative to the first")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--slots", type=int, default=128)
  ap.add_argument("--out", default="")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="override a config key after the smoke shape (repeatable)")
  a = ap.parse_args()
  if a.steps < 2:
    ap.error(f"--steps={a.steps}: at least 2 (step 1 compiles and is not in the medians)")
  results = [run_config(p, a) for p in a.configs.split(",")]
  base = results[0]["median"]["step_s"]
  print("\n| config | mode | KV | step s | rollout s | train s | requant s | gen tok/s | token_mult_prob_error "
        "| peak GiB per device so far | planned GiB | step s / first's |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    m = r["median"]
    print(f"| {os.path.basename(r['config'])} | {r['mode']} | {r['kv_cache']} | {m['step_s']:.3f} | "
          f"{m['rollout_s']:.3f} | {m['train_s']:.3f} | {m['requant_s']:.3f} | {m['gen_tokens_per_s']:.0f} | "
          f"{m['token_mult_prob_error']:.6f} | {r['peak_gib'] or float('nan'):.1f} | {r['plan_peak_gib']:.1f} | "
          f"{m['step_s'] / base:.2f} |")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({**provenance(), "args": vars(a),
                 "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
