"""FP8 in generation only (fp8.mode='fp8_rollout'): the corrections' losses against their formulas, and the parity
script end to end (scripts/parity.py --smoke)."""

import fp8jax

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.diagnostics import parity
from fp8jax.model import llama
from fp8jax.rl import trainer as trainer_lib
from test_trainer import REPO, parity_reward, small_config  # noqa: F401  (parity_reward: a fixture)

LO, HI = 0.995, 1.005  # tight IS bounds, so that the FP8-vs-BF16 gap (|dlp| ~ 0.006 on average) leaves tokens outside


def _expected_weights(kind, train_lp, gen_lp):
  """pi_train / pi_gen per token as fp8jax.rl.grpo documents each kind, written out again in NumPy."""
  r = np.exp(train_lp.astype(np.float64) - gen_lp)
  if kind == "none":
    return np.ones_like(r)
  if kind == "tis":
    return np.clip(r, LO, HI)
  assert kind == "icepop"
  return np.where((r >= LO) & (r <= HI), r, 0.0)


def test_recompute_and_is_corrections_change_the_loss_as_the_formulas_say(tmp_path, monkeypatch, parity_reward):
  """One rollout, four ways to train on it (same weights, same tokens):

  * the mode's default, old log-probs = the FP8 sampler's: ``loss = mean_t max(-A r, -A clip(r, 1-eps, 1+eps))``
    with ``r = exp(train - gen)``, the BF16 trainer over the FP8 generator;
  * ``recompute_old_logp`` with is_kind none / tis / icepop: old = the trainer's own log-probs, so in the first
    minibatch the PPO ratio is 1 and ``loss = -sum_t w_t A / N_tok`` with ``w`` the kind's weight of ``r``.

  The trainer's BF16 log-probs are recomputed here independently (``llama.next_token_logprobs`` on the master
  weights), the generator's come from the rollout, and the weights and losses are evaluated in NumPy.
  """
  c = small_config(**{"fp8.mode": "fp8_rollout", "grpo.is_lo": LO, "grpo.is_hi": HI})
  tr = trainer_lib.RLTrainer(c, str(tmp_path))
  tr.warmstart()
  params0 = jax.tree.map(np.asarray, tr.state.params)
  rollouts, batches = [], []
  real_generate, real_step = tr.worker.sampler.generate, tr.learner.train_step
  monkeypatch.setattr(tr.worker.sampler, "generate", lambda *a, **kw: rollouts.append(real_generate(*a, **kw)) or
                      rollouts[-1])
  monkeypatch.setattr(tr.learner, "train_step", lambda state, mb: batches.append(jax.tree.map(np.asarray, mb)) or
                      real_step(state, mb))
  metrics = {}
  for name, recompute, kind in (("sampler", False, "none"), ("none", True, "none"), ("tis", True, "tis"),
                                ("icepop", True, "icepop")):
    # The same starting point each time: the warm-started weights, a fresh optimizer, prompt batch 0, KV scales
    # calibrated again (load_pretrained's fresh state). (is_kind and recompute_old_logp act in Learner.prepare,
    # outside the jitted steps, whose loss reads neither: replacing them on the learner is enough.)
    tr.learner.gc = dataclasses.replace(tr.gc, recompute_old_logp=recompute, is_kind=kind)
    tr.load_pretrained(params0)
    metrics[name] = tr.step(0)
  ro = rollouts[-1]
  tokens, mask, gen_lp = ro.sequences(pad_id=tr.task.pad_id)
  for other in rollouts[1:-1] + [rollouts[0]]:  # the same rollout every time
    np.testing.assert_array_equal(other.tokens, ro.tokens)
  assert len(batches) == 4  # one minibatch per step
  adv_B = batches[0]["adv"]
  lp = fp8jax.jit(lambda p, t: llama.next_token_logprobs(p, t, tr.cfg, tr.learner.policy.lcfg,
                                                        temperature=tr.worker.sp.temperature)[0])
  train_lp = np.asarray(lp(jax.tree.map(jnp.asarray, params0), jnp.asarray(tokens)))
  on = mask > 0
  n_tok = mask.sum()
  adv = np.broadcast_to(adv_B[:, None], mask.shape)
  assert np.any(adv[on] != 0)

  # The default: the sampler's log-probs are the old policy; the trainer's current ones (= train_lp) are new.
  np.testing.assert_array_equal(batches[0]["old_logp"][on], gen_lp[on])
  assert "is_weights" not in batches[0]
  r = np.exp(train_lp.astype(np.float64) - gen_lp)
  eps_lo, eps_hi = tr.gc.eps_low, tr.gc.eps_high
  pg = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps_lo, 1 + eps_hi))
  np.testing.assert_allclose(float(metrics["sampler"]["loss"]), pg[on].sum() / n_tok, rtol=0, atol=2e-5)

  for i, kind in enumerate(("none", "tis", "icepop"), start=1):
    b = batches[i]
    # The recomputed old log-probs are the trainer's BF16 ones (up to FP32 reduction order over the batch).
    np.testing.assert_allclose(b["old_logp"][on], train_lp[on], rtol=0, atol=1e-5)
    w = _expected_weights(kind, b["old_logp"], gen_lp)
    if kind == "none":
      assert "is_weights" not in b
    else:
      np.testing.assert_allclose(b["is_weights"][on], w[on], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(metrics[kind]["loss"]), -(w * adv)[on].sum() / n_tok, rtol=0, atol=2e-5)
    if kind != "none":
      # Not vacuous: the FP8-vs-BF16 gap puts many trained tokens (with nonzero advantage) outside [LO, HI], where
      # the kind's weight is not 1. (The loss differences themselves are sums of A (w - 1) of either sign.)
      changed = np.mean((np.abs(w - 1) > 1e-3)[on & (adv != 0)])
      assert changed > 0.05, (kind, changed)
  r_tis = np.exp(batches[2]["old_logp"].astype(np.float64) - gen_lp)[on]  # the ratios the trainer bounded
  oob = np.mean((r_tis < LO) | (r_tis > HI))
  np.testing.assert_allclose(float(metrics["tis"]["is_is_oob_frac"]), oob, atol=1e-6)
  for m in metrics.values():
    assert float(m["token_mult_prob_error"]) > 1 + 1e-3


def test_summaries_of_synthetic_runs():
  rows = [{"step": 0, "val_accuracy": 0.5},
          {"step": 1, "token_mult_prob_error": 1.01, "gen_kl_error": 1e-4, "step_s": 9.0},
          {"step": 2, "token_mult_prob_error": 1.03, "gen_kl_error": 3e-4, "step_s": 1.0, "val_accuracy": 0.75},
          {"step": 3, "token_mult_prob_error": 1.02, "gen_kl_error": 2e-4, "step_s": 2.0, "val_accuracy": 0.625}]
  s = parity.summarize_run(rows)
  assert (s["start_val_accuracy"], s["final_val_accuracy"], s["best_val_accuracy"]) == (0.5, 0.625, 0.75)
  np.testing.assert_allclose([s["token_mult_prob_error"], s["gen_kl_error"], s["step_s_median"]], [1.02, 2e-4, 2.0])
  arm = parity.summarize_arm([s, dict(s, final_val_accuracy=0.875)])
  np.testing.assert_allclose([arm["final_val_accuracy"]["mean"], arm["final_val_accuracy"]["std"]],
                             [0.75, np.std([0.625, 0.875], ddof=1)])
  with pytest.raises(ValueError, match="--arms"):
    parity.check_arms(["fp8", "fp4"])
  with pytest.raises(KeyError, match="grpo.is_kindd"):
    parity.override(small_config(), {"grpo.is_kindd": "tis"})


def test_table_from_runs_of_a_pretrained_model_needs_no_warm_start(tmp_path):
  """warmstart.steps = 0 (a pretrained checkpoint): the arms ran as scripts/train.py runs, one directory per arm and
  seed; --table_only builds the table from their rows, the start being their step-0 validation; a run that did not
  finish is named, and one that went further counts up to --steps only. (--arm_flags prints the flags those runs
  take: each arm's overrides.)"""
  base = parity.override(small_config(), {"warmstart.steps": 0})
  finals = {("bf16", 0): 0.5, ("bf16", 1): 0.75, ("fp8", 0): 0.625, ("fp8", 1): 0.625}
  for (arm, seed), final in finals.items():
    d = tmp_path / arm / f"seed{seed}"
    d.mkdir(parents=True)
    rows = [{"step": 0, "val_accuracy": 0.25},
            {"step": 1, "token_mult_prob_error": 1.0, "gen_kl_error": 0.0, "step_s": 3.0},
            {"step": 2, "token_mult_prob_error": 1.0, "gen_kl_error": 0.0, "step_s": 2.0, "val_accuracy": final}]
    if (arm, seed) != ("fp8", 1):  # the one run stopped after step 2; the others went on, beyond the table's 2
      rows.append({"step": 3, "token_mult_prob_error": 9.0, "gen_kl_error": 0.0, "step_s": 2.0,
                   **({"val_accuracy": 0.875} if (arm, seed) == ("bf16", 0) else {})})
    d.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "table.json"
  result = parity.run_parity(base, arms=["bf16", "fp8"], seeds=2, steps=2, val_every=2, workdir=str(tmp_path),
                             out_json=str(out), out_png=str(tmp_path / "t.png"), table_only=True, echo=lambda *_: None)
  assert result["warmstart"]["val_accuracy"] == 0.25
  fin = {n: a["summary"]["final_val_accuracy"] for n, a in result["arms"].items()}
  np.testing.assert_allclose([fin["bf16"]["mean"], fin["bf16"]["std"], fin["fp8"]["mean"], fin["fp8"]["std"]],
                             [0.625, np.std([0.5, 0.75], ddof=1), 0.625, 0.0])
  # the table's horizon is --steps: rows after step 2 count nowhere (their validations are listed apart)
  table = json.loads(out.read_text())["arms"]
  assert table["fp8"]["summary"]["step_s_median"]["mean"] == 2.5
  assert table["bf16"]["summary"]["token_mult_prob_error"]["mean"] == 1.0
  assert [r["val_curve_beyond"] for r in table["bf16"]["runs"]] == [[[3, 0.875]], []]
  with pytest.raises(FileNotFoundError, match="fp8/seed1/metrics.jsonl: the run has not finished 3 RL steps"):
    parity.run_parity(base, arms=["bf16", "fp8"], seeds=2, steps=3, val_every=2, workdir=str(tmp_path),
                      out_json=str(out), out_png=str(tmp_path / "t.png"), table_only=True, echo=lambda *_: None)
  res = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "parity.py"), "--arm_flags=fp8_rollout_tis"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.split() == [f"--config.{k}={v}" for k, v in parity.ARMS["fp8_rollout_tis"].items()]


def test_parity_smoke_runs_the_script_and_writes_json_and_png(tmp_path):
  """scripts/parity.py --smoke, end to end (two of the arms, to keep CI short: BF16 and FP8 in generation only with
  recompute + TIS, the arm with the most machinery; the generation-only trainer runs in tests/test_trainer.py): one
  BF16 warm start, the arms from it, the table, the JSON and the PNG."""
  out = tmp_path / "parity.json"
  cmd = [sys.executable, os.path.join(REPO, "scripts", "parity.py"), "--smoke", "--steps=2",
         "--arms=bf16,fp8_rollout_tis", f"--workdir={tmp_path / 'runs'}", f"--out={out}"]
  res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  result = json.loads(out.read_text())
  assert list(result["arms"]) == ["bf16", "fp8_rollout_tis"]
  for name, arm in result["arms"].items():
    assert name in res.stdout
    (run,) = arm["runs"]
    assert [s for s, _ in run["val_curve"]] == [0, 1, 2]
    # every arm starts from the one warm start: the BF16 arm validates it exactly as the warm start did (same
    # weights, same sampler); the FP8 samplers' greedy answers may differ a little
    tol = 0.0 if name == "bf16" else 0.25
    assert abs(run["start_val_accuracy"] - result["warmstart"]["val_accuracy"]) <= tol
    assert set(arm["summary"]) == set(parity.SUMMARY_KEYS)
  mm = {n: a["summary"]["token_mult_prob_error"]["mean"] for n, a in result["arms"].items()}
  assert mm["bf16"] <= 1 + 1e-5 and mm["fp8_rollout_tis"] > 1 + 1e-4, mm
  png = tmp_path / "parity.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert result["provenance"]["command"].startswith(cmd[1])

  # --table_only (runs made in parallel processes, docs/parity.md): the same table from the finished runs, training
  # nothing; a seed that was never run is named, not skipped
  table = tmp_path / "table.json"
  res = subprocess.run(cmd[:-1] + [f"--out={table}", "--table_only"], capture_output=True, text=True, cwd=REPO,
                       timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  again = json.loads(table.read_text())
  assert {n: a["summary"] for n, a in again["arms"].items()} == {n: a["summary"] for n, a in result["arms"].items()}
  res = subprocess.run(cmd[:-1] + [f"--out={table}", "--table_only", "--first_seed=1"], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
  assert res.returncode != 0 and "bf16/seed1/metrics.jsonl: the run has not finished 2 RL steps" in res.stderr
