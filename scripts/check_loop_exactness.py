"""Is the GRPO loop exact and deterministic? The rollout, the trainer's log-probs and the train step, each twice.

  python scripts/check_loop_exactness.py --config configs/llama8b_fp8.py [--steps 5] [--out FILE.json]

Builds ``fp8jax.rl.trainer.RLTrainer`` from the config at the 8B-width GRPO smoke's shape (--layers 2, 16 prompts x
8 samples, 128 slots, 16 new tokens, arithmetic prompts, random weights; KL off) and runs its pieces step by step,
each step in this process:
  * the rollout twice on the same weights and seed: tokens and log-probs bitwise equal?
  * the trainer's log-probs twice on the first 32 sequences, and once on all of them: repeat bitwise? the 32 rows
    bitwise the same rows of the whole batch (batch invariance of the trainer)?
  * sampler vs trainer on **all** sequences (the trainer's metric samples grpo.mismatch_sample of them): how many
    sampled tokens differ, and by how much;
  * the train step twice from one state: every leaf of the new state (parameters and the optimizer's moments, whose
    second moment keeps a gradient's last bits that Adam's small update may round away from the parameters) and
    every metric bitwise equal?
then continues the loop from the first update (the next rollout's FP8 KV scales from its amax, as the trainer does).
It calls the loop's public pieces: ``RolloutWorker.refit`` / ``generate``, ``rollout.train_batch``,
``Learner.logprobs`` / ``train_step``.
Prints one JSON line per step. XLA options under test go in XLA_FLAGS (docs/performance.md "One-engine exactness").
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax.config_utils import load_config_file, smoke_shape  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402
from fp8jax.rl import rollout  # noqa: E402
from fp8jax.rl.trainer import RLTrainer  # noqa: E402


def load_config(path, a):
  c = smoke_shape(load_config_file(path), a.layers, a.slots)
  if a.kv_cache:
    with c.unlocked():
      c.fp8.kv_cache = a.kv_cache
  return c


def bitwise(a, b) -> bool:
  return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def differing_leaves(a, b) -> list[str]:
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  return [jax.tree_util.keystr(path) for (path, x), y in zip(flat_a, jax.tree.leaves(b)) if not bitwise(x, y)]


def check_step(tr: RLTrainer, step: int) -> dict:
  gc, learner, worker = tr.gc, tr.learner, tr.worker
  tr.start_rl()  # the KV scales (and reference) the loop starts from
  sparams = worker.refit(tr.state.params)
  prompts, answers = tr.task.train_prompts(gc.num_prompts, step=step)
  ro, ro2 = (worker.generate(sparams, prompts, n=gc.num_generations, seed=1000 + step, kv_scales=tr.state.kv_scales)
             for _ in range(2))
  (s1, _, o1), (s2, _, o2) = ro.sequences(pad_id=tr.task.pad_id), ro2.sequences(pad_id=tr.task.pad_id)
  r = {"step": step, "rollout_repeat_bitwise": bitwise(s1, s2) and bitwise(o1, o2)}
  rewards = tr.task.score(ro, [answers[i] for i in ro.prompt_idx]).reshape(gc.num_prompts, gc.num_generations)
  batch, _ = rollout.train_batch([(ro, np.ones(gc.num_prompts, bool))], [rewards], gc, tr.task.pad_id)
  kv = tr.state.kv_scales if learner.fp8_kv else None
  tok = jnp.asarray(batch["tokens"])
  lp32, lp32b, lp_all = (np.asarray(learner.logprobs(tr.state.params, t, kv_scales=kv)[0])
                         for t in (tok[:32], tok[:32], tok))
  r["trainer_repeat_bitwise"], r["trainer_rows_batch_invariant"] = bitwise(lp32, lp32b), bitwise(lp32, lp_all[:32])
  d = np.where(batch["mask"] > 0, np.abs(lp_all - batch["old_logp"]), 0.0)
  r.update(tokens=int((batch["mask"] > 0).sum()), sampler_vs_trainer_tokens_differ=int((d > 0).sum()),
           sampler_vs_trainer_max_abs_dlp=float(d.max()))
  mb = dict(batch, **({"kv_scales": kv} if kv is not None else {}))
  state0 = jax.tree.map(jnp.copy, tr.state)
  new, m1 = learner.train_step(jax.tree.map(jnp.copy, state0), dict(mb))
  again, m2 = learner.train_step(state0, dict(mb))  # the step donates its state: each call gets its own copy
  r["train_step_leaves_differ"] = differing_leaves(new, again)
  r["train_step_metrics_differ"] = sorted(k for k in m1 if not bitwise(m1[k], m2[k]))
  del again
  tr.state = new  # its KV scales are the next rollout's (from this step's K/V amax), as in the loop
  return r


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--kv_cache", default="", help="override fp8.kv_cache (bf16 | fp8)")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--slots", type=int, default=128)
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  tr = RLTrainer(load_config(a.config, a), tempfile.mkdtemp())
  rows = []
  for step in range(a.steps):
    t0 = time.perf_counter()
    r = check_step(tr, step)
    r["s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(r), flush=True)
    rows.append(r)
  if a.out:
    with open(a.out, "w") as f:
      json.dump({**provenance(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
