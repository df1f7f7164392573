"""Multi-process runs on one machine: scripts/train.py in 2 processes through jax.distributed (gloo on CPU)."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from fp8jax import distributed
from fp8jax.checkpoint import MANIFEST
import child_process  # tests/child_process.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config=configs/tiny_fp8.py", "--config.warmstart.steps=3", "--config.train.steps=2",
        "--config.train.val_every=2", "--config.train.val_prompts=8", "--config.grpo.num_prompts=2",
        "--config.grpo.num_generations=4", "--config.grpo.microbatch=8", "--config.grpo.mismatch_sample=4",
        "--config.rollout.slots=8", "--config.checkpoint.every=1"]


def test_partial_or_bad_settings_name_the_variable():
  assert distributed.initialize_from_env({}) is False  # single process: nothing to start
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID not set"):
    distributed.initialize_from_env({"JAX_COORDINATOR_ADDRESS": "localhost:1234"})
  bad = {"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
    distributed.initialize_from_env(bad)
  with pytest.raises(ValueError, match=r"JAX_PROCESS_ID=2 must be in \[0, JAX_NUM_PROCESSES=2\)"):
    distributed.initialize_from_env(dict(bad, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="2"))


def test_the_persistent_cache_is_turned_off_for_multi_process_cpu_runs(tmp_path, caplog):
  """A multi-process CPU run aborts in gloo once JAX's persistent cache holds its programs (the guard's docstring):
  initialize_from_env turns the cache off there, saying so; single-process and non-CPU runs keep it."""
  saved = jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", saved[1] or str(tmp_path))
    jax.config.update("jax_enable_compilation_cache", True)
    assert not distributed.persistent_cache_guard("gpu", 2)
    assert not distributed.persistent_cache_guard("cpu", 1)
    assert jax.config.jax_enable_compilation_cache and not caplog.records
    with caplog.at_level("WARNING", logger="fp8jax.distributed"):
      assert distributed.persistent_cache_guard("cpu", 2)
    assert not jax.config.jax_enable_compilation_cache
    assert "persistent compilation cache" in caplog.text and "2-process CPU run" in caplog.text
  finally:
    jax.config.update("jax_enable_compilation_cache", saved[0])
    jax.config.update("jax_compilation_cache_dir", saved[1])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# scripts/train.py with the tests' parity reward (test_trainer._parity_score): the 3-step warm start scores 0 on the
# real task, which would make every advantage, loss and gradient 0 and their comparison below 0 == 0.
TRAIN_WITH_PARITY_REWARD = (
    "import runpy, sys; sys.path[:0] = [{repo!r}, {tests!r}]; "
    "from fp8jax.rl import source; from test_trainer import _parity_score; "
    "source.ArithmeticSource.score = _parity_score; sys.argv = [{script!r}] + sys.argv[1:]; "
    "runpy.run_path({script!r}, run_name='__main__')").format(
        repo=REPO, tests=os.path.join(REPO, "tests"), script=os.path.join(REPO, "scripts", "train.py"))


def _train(workdir, env_extra, devices_per_process):
  return subprocess.Popen([sys.executable, "-c", TRAIN_WITH_PARITY_REWARD, *TINY, f"--workdir={workdir}"],
                          cwd=REPO, env=child_process.env(devices_per_process, **env_extra), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_two_process_run_equals_one_process_on_the_same_mesh(tmp_path):
  """The tiny default (with the tests' parity reward, so that losses and gradients are not 0) in 2 processes of 1 CPU
  device each (a 2-device global mesh, fsdp over both) vs 1 process with 2 fake devices (the same mesh): both exit 0;
  the run directory gets one metrics row per step (written by process 0 only), a plot, checkpoints with manifests; the
  rollouts are the same (reward_mean equal at every step) and loss, grad_norm within FP32 summation order (gloo vs
  in-process reductions); sampler == trainer in both. Then a resume of the 2-process run (train.steps 2 -> 3) continues
  from its checkpoint."""
  one = _train(tmp_path / "one", {}, 2)
  port = _free_port()
  multi = tmp_path / "multi"
  procs = [_train(multi, {"JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
                          "JAX_PROCESS_ID": str(i)}, 1) for i in range(2)]
  for p in [one, *procs]:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
  a, b = _rows(tmp_path / "one"), _rows(multi)
  assert [r["step"] for r in b] == [0, 1, 2] == [r["step"] for r in a]  # one row per step: one writer
  assert os.path.isfile(multi / "metrics.png")
  assert os.path.isfile(multi / "checkpoints" / "2" / MANIFEST)
  # the parity reward gives the groups variance: real losses and gradients are compared, not zeros
  assert any(0 < r["reward_mean"] < 1 and r["grad_norm"] > 0 for r in a[1:]), a
  for ra, rb in zip(a[1:], b[1:]):
    assert ra["reward_mean"] == rb["reward_mean"]
    for k in ("loss", "grad_norm"):
      np.testing.assert_allclose(rb[k], ra[k], rtol=2e-2, atol=1e-5)
    assert abs(rb["token_mult_prob_error"] - 1.0) < 1e-4
  port = _free_port()
  procs = [subprocess.Popen(p.args + ["--config.train.steps=3"], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=child_process.env(1, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                                                  JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
           for i, p in enumerate(procs)]
  errs = []
  for p in procs:
    _, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    errs.append(err)
  assert [r["step"] for r in _rows(multi)] == [0, 1, 2, 3]
  assert all("resumed from" in e and "at step 2" in e for e in errs)
