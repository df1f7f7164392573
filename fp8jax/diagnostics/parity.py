"""Accuracy parity (issue 18): GRPO arms BF16, FP8 end to end and FP8 in generation only, from one warm start.

The recipe's claim is an accuracy table (NeMo RL, Llama-3.1-8B: BF16 0.616, FP8 end to end 0.613, FP8 in generation
only 0.586). Here every arm starts from the *same* warm-start weights (one BF16 supervised warm start, trained once and
checkpointed), so the arms differ only in their recipe and correction, and each arm runs several RL seeds
(``rollout.seed``: the rollouts' sampling; the problems, the validation set and the warm start stay the same).

Arms (``ARMS``; config overrides of the base config):

* ``bf16``: BF16 sampler and trainer (one engine).
* ``fp8``: FP8 sampler and trainer, FP8 KV cache per the base config (one engine).
* ``fp8_rollout``: FP8 in generation only, the sampler's log-probs as the old policy (the mode's default). The PPO
  ratio is then ``pi_train / pi_gen``, i.e. a token-level importance ratio clipped at ``1 +- eps`` (an implicit
  correction).
* ``fp8_rollout_recompute``: old log-probs recomputed by the BF16 trainer, no importance weights: the mismatch
  uncorrected (NeMo RL's FP8-generation setup with its correction off).
* ``fp8_rollout_tis`` / ``fp8_rollout_icepop``: the recompute plus truncated IS / IcePop weights (fp8jax.rl.grpo).

``run_parity`` writes the table as JSON and the validation curves as a PNG (one colour per arm); scripts/parity.py is
its command line, docs/parity.md says how it was run.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np

from fp8jax import config_utils
from fp8jax.checkpoint import Checkpointer
from fp8jax.diagnostics.provenance import provenance
from fp8jax.metrics import read_jsonl
from fp8jax.rl import trainer as trainer_lib

log = logging.getLogger(__name__)

_ROLLOUT = {"fp8.mode": "fp8_rollout"}
_RECOMPUTE = dict(_ROLLOUT, **{"grpo.recompute_old_logp": True})
ARMS: dict[str, dict] = {
    "bf16": {"fp8.mode": "bf16", "fp8.kv_cache": "bf16"},
    "fp8": {"fp8.mode": "fp8"},
    "fp8_rollout": dict(_ROLLOUT, **{"grpo.is_kind": "none"}),
    "fp8_rollout_recompute": dict(_RECOMPUTE, **{"grpo.is_kind": "none"}),
    "fp8_rollout_tis": dict(_RECOMPUTE, **{"grpo.is_kind": "tis"}),
    "fp8_rollout_icepop": dict(_RECOMPUTE, **{"grpo.is_kind": "icepop"}),
}

# The --smoke preset: the tiny task with a short warm start, few small RL steps; minutes on 2 CPU cores.
SMOKE = {"warmstart.steps": 30, "grpo.num_prompts": 8, "grpo.num_generations": 4, "grpo.microbatch": 32,
         "grpo.mismatch_sample": 8, "rollout.slots": 32, "train.val_prompts": 32}
SMOKE_STEPS, SMOKE_VAL_EVERY = 3, 1


def override(config, overrides: dict):
  """``config_utils.override`` for the arms and presets."""
  return config_utils.override(config, overrides, "parity (an arm or preset)")


def check_arms(names) -> list[str]:
  names = list(names)
  bad = [n for n in names if n not in ARMS]
  if bad or not names:
    raise ValueError(f"--arms: {bad or 'none given'} not among {list(ARMS)}")
  return names


def arm_config(base, arm: str, seed: int, steps: int, val_every: int, workdir: str):
  c = override(base, {**ARMS[arm], "rollout.seed": int(seed), "train.steps": int(steps),
                      "train.val_every": int(val_every),
                      "checkpoint.every": max(int(steps), 1)})  # one checkpoint, at the end (a rerun resumes)
  c.workdir = workdir
  return c


# ------------------------------------------------------------------------------------------------------------------
# The shared warm start
# ------------------------------------------------------------------------------------------------------------------


def _warm_key(c) -> dict:
  """What the warm start depends on: a stored one is reused only when all of it matches."""
  return json.loads(json.dumps({"seed": int(c.seed), "model": c.model.to_dict(), "warmstart": c.warmstart.to_dict(),
                                "task": c.task, "arithmetic": c.arithmetic.to_dict(), "data": c.data.to_dict(),
                                "seq_len": int(c.rollout.max_len)}))


def stored_warm_info(base, directory: str, required: bool = True) -> dict | None:
  """The stored warm start's info (its validation accuracy, ...), None if there is none and not ``required``; one
  made with other settings (``_warm_key``) raises, naming the directory."""
  key = _warm_key(override(base, {**ARMS["bf16"], "train.steps": 0}))
  ckpt = Checkpointer(os.path.join(directory, "params"), keep=1)
  if ckpt.latest_step() is None:
    if required:
      raise FileNotFoundError(f"no warm start in {directory}: run scripts/parity.py without --table_only first")
    return None
  meta = ckpt.read_meta(0)
  if meta["key"] != key:
    raise ValueError(f"the warm start in {directory} was made with other settings ({meta['key']}, now {key}): "
                     f"use another --workdir, or delete {directory}")
  return meta["info"]


def warm_start(base, directory: str) -> tuple[dict, dict]:
  """The BF16 supervised warm start of ``base``, trained once and checkpointed in ``directory``; returns
  ``(master params, info)``. A checkpoint made with other settings (``_warm_key``) raises, naming the directory."""
  c = override(base, {**ARMS["bf16"], "train.steps": 0})
  key = _warm_key(c)
  tr = trainer_lib.RLTrainer(c, os.path.join(directory, "trainer"))
  ckpt = Checkpointer(os.path.join(directory, "params"), keep=1)
  if stored_warm_info(base, directory, required=False) is not None:
    params, meta = ckpt.restore(0, tr.state.params)
    return params, meta["info"]
  ws = tr.warmstart()
  info = {**ws, **tr.validate(), "recipe": "bf16"}
  ckpt.save(0, tr.state.params, {"key": key, "info": info})
  return tr.state.params, info


# ------------------------------------------------------------------------------------------------------------------
# Arms and the table
# ------------------------------------------------------------------------------------------------------------------


def _mean_std(xs):
  xs = [x for x in xs if x is not None]
  if not xs:
    return None, None
  return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def summarize_run(rows: list[dict], steps: int | None = None) -> dict:
  """One run's figures from its metrics rows (row 0: the warm start's validation, before any RL step), over its first
  ``steps`` RL steps (all by default; a run may have gone further than the table's horizon: its later validations
  are kept in ``val_curve_beyond``)."""
  beyond = [(r["step"], r["val_accuracy"]) for r in rows
            if steps is not None and r["step"] > steps and "val_accuracy" in r]
  rows = [r for r in rows if steps is None or r["step"] <= steps]
  val = [(r["step"], r["val_accuracy"]) for r in rows if "val_accuracy" in r]
  rl = [r for r in rows if r["step"] >= 1]
  rl_val = [a for s, a in val if s >= 1]

  def mean_of(k):
    v = [r[k] for r in rl if k in r]
    return float(np.mean(v)) if v else None

  return {"val_curve": val, "val_curve_beyond": beyond,
          "start_val_accuracy": val[0][1] if val and val[0][0] == 0 else None,
          "final_val_accuracy": rl_val[-1] if rl_val else None, "best_val_accuracy": max(rl_val) if rl_val else None,
          "token_mult_prob_error": mean_of("token_mult_prob_error"), "gen_kl_error": mean_of("gen_kl_error"),
          "step_s_median": float(np.median([r["step_s"] for r in rl])) if rl else None,
          "mismatch_curve": [(r["step"], r["token_mult_prob_error"]) for r in rl if "token_mult_prob_error" in r]}


SUMMARY_KEYS = ("final_val_accuracy", "best_val_accuracy", "token_mult_prob_error", "gen_kl_error", "step_s_median")


def summarize_arm(runs: list[dict]) -> dict:
  out = {}
  for k in SUMMARY_KEYS:
    m, s = _mean_std([r[k] for r in runs])
    out[k] = {"mean": m, "std": s}
  return out


def format_table(result: dict) -> str:
  def ms(d, fmt):
    return "n/a" if d["mean"] is None else f"{d['mean']:{fmt}} +- {d['std']:{fmt}}"

  head = ("arm", "seeds", "final val acc", "best val acc", "token_mult_prob_error", "gen_kl_error", "step s (median)")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, arm in result["arms"].items():
    s = arm["summary"]
    lines.append("| " + " | ".join((name, str(len(arm["runs"])), ms(s["final_val_accuracy"], ".3f"),
                                    ms(s["best_val_accuracy"], ".3f"), ms(s["token_mult_prob_error"], ".6f"),
                                    ms(s["gen_kl_error"], ".2e"), ms(s["step_s_median"], ".2f"))) + " |")
  return "\n".join(lines)


def plot_curves(result: dict, path: str) -> str:
  """Validation accuracy (and token_mult_prob_error) over RL steps: one colour per arm, mean bold, seeds faint."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, (ax_acc, ax_mm) = plt.subplots(1, 2, figsize=(11, 4))
  colours = plt.get_cmap("tab10")
  for i, (name, arm) in enumerate(result["arms"].items()):
    col = colours(i % 10)
    for ax, key in ((ax_acc, "val_curve"), (ax_mm, "mismatch_curve")):
      curves = [dict(map(tuple, r[key])) for r in arm["runs"]]
      for cv in curves:
        if cv:
          ax.plot(list(cv), list(cv.values()), color=col, alpha=0.25, linewidth=1)
      steps = sorted(set.intersection(*(set(cv) for cv in curves))) if curves else []
      if steps:
        ax.plot(steps, [np.mean([cv[s] for cv in curves]) for s in steps], color=col, linewidth=2,
                marker="o", markersize=3, label=name)
  ax_acc.set_title("greedy validation accuracy (mean of seeds; faint: each seed)")
  ax_mm.set_title("token_mult_prob_error (sampler vs trainer)")
  for ax in (ax_acc, ax_mm):
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  ax_acc.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _read_rows(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, "metrics.jsonl")
  return read_jsonl(path) if os.path.exists(path) else []


def run_parity(base, *, arms, seeds: int, steps: int, val_every: int, workdir: str, out_json: str, out_png: str,
               command: str = "", progress: bool = False, echo=print, first_seed: int = 0,
               table_only: bool = False) -> dict:
  """Warm start once, then every (arm, seed) run from it (seeds ``first_seed .. first_seed + seeds - 1``); writes
  ``out_json`` and ``out_png``; returns the result. ``table_only``: trains nothing, reads the finished runs (e.g.
  run in parallel processes) and raises naming the first that is missing or unfinished."""
  arms = check_arms(arms)
  if seeds < 1:
    raise ValueError(f"--seeds={seeds} must be >= 1")
  if first_seed < 0:
    raise ValueError(f"--first_seed={first_seed} must be >= 0")
  if steps < 1:
    raise ValueError(f"--steps={steps} must be >= 1")
  if table_only:
    # Without a warm start (warmstart.steps = 0: every run starts from the checkpoint, e.g. a pretrained
    # checkpoint.hf_dir) runs made by scripts/train.py with the arms' overrides need none: their step-0 rows hold it.
    warm_info = stored_warm_info(base, os.path.join(workdir, "warmstart"), required=int(base.warmstart.steps) > 0)
    if warm_info is None:
      rows = _read_rows(os.path.join(workdir, arms[0], f"seed{first_seed}"))
      start = [r["val_accuracy"] for r in rows if r["step"] == 0 and "val_accuracy" in r]
      if not start:
        raise FileNotFoundError(f"no warm start in {os.path.join(workdir, 'warmstart')} and no step-0 validation in "
                                f"{os.path.join(workdir, arms[0], f'seed{first_seed}', 'metrics.jsonl')}")
      warm_info = {"val_accuracy": start[0], "source": "the runs' step-0 validation (warmstart.steps = 0)"}
  else:
    warm_params, warm_info = warm_start(base, os.path.join(workdir, "warmstart"))
    warm_np = jax.tree.map(np.asarray, warm_params)
  echo(f"warm start (BF16, {base.warmstart.steps} steps): greedy validation accuracy {warm_info['val_accuracy']:.3f}")
  result = {"provenance": provenance(command), "warmstart": warm_info, "steps": steps, "seeds": seeds,
            "base": {"difficulty": base.arithmetic.difficulty if base.task == "arithmetic" else None,
                     "model": base.model.to_dict(), "grpo": dict(base.grpo), "kv_cache": base.fp8.kv_cache},
            "arms": {}}
  for arm in arms:
    runs = []
    for seed in range(first_seed, first_seed + seeds):
      wd = os.path.join(workdir, arm, f"seed{seed}")
      if not table_only:
        tr = trainer_lib.RLTrainer(arm_config(base, arm, seed, steps, val_every, wd), wd)
        tr.load_pretrained(warm_np)
        tr.run(progress=progress)
      path = os.path.join(wd, "metrics.jsonl")
      rows = _read_rows(wd)
      if table_only and max((r["step"] for r in rows), default=-1) < steps:
        raise FileNotFoundError(f"{path}: the run has not finished {steps} RL steps (run it without --table_only)")
      run = {"seed": seed, "workdir": wd, **summarize_run(rows, steps)}
      runs.append(run)
      echo(f"{arm} seed {seed}: validation {run['start_val_accuracy']} -> {run['final_val_accuracy']} "
           f"(best {run['best_val_accuracy']}), token_mult_prob_error {run['token_mult_prob_error']}")
    result["arms"][arm] = {"overrides": ARMS[arm], "runs": runs, "summary": summarize_arm(runs)}
  os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
  result["png"] = out_png
  with open(out_json, "w") as f:
    json.dump(result, f, indent=1)
  plot_curves(result, out_png)
  return result
