"""The per-device memory plan (fp8jax/rl/memory.py, scripts/plan_memory.py) against sizes derived independently, and
the trainer's refusal of a run that cannot fit."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from fp8jax.rl import memory
from fp8jax.rl.trainer import RLTrainer, memory_plan
from test_trainer import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def _plan_script(*args):
  out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"plan_{os.getpid()}_{len(args)}.json")
  r = subprocess.run([sys.executable, os.path.join(REPO, "scripts/plan_memory.py"), "--config=configs/llama8b_fp8.py",
                      f"--json={out}", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                     env={k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")})
  with open(out) as f:
    return r, json.load(f)


def test_the_8b_recipe_on_8_gpus_is_planned_from_its_parameter_count():
  """Llama-3.1-8B on 8 devices (fsdp 8): the master weights' and moments' shards, the sampler's FP8 weights whole on
  every device (data-parallel rollouts) and one device's FP8 KV pool, each from the architecture's numbers; and the
  same recipe on one device is refused naming mesh.fsdp."""
  r, p = _plan_script("--devices=8", "--device_gib=139")
  assert r.returncode == 0, r.stderr[-3000:]
  V, D, L, H, K, hd, F = 128256, 4096, 32, 32, 8, 128, 14336
  matrices = 2 * V * D + L * (H * hd * D * 2 + 2 * K * hd * D + 3 * F * D)  # embed, head; q, o; k, v; gate, up, down
  norms = L * 2 * D + D
  assert matrices + norms == 8_030_261_248  # Llama-3.1-8B's published parameter count
  master = 4 * (matrices // 8 + norms)  # every matrix splits 8 ways over fsdp, the norms are replicated
  assert p["state"]["master params (FP32)"] == master
  assert 0 <= p["state"]["optimizer state"] - 2 * master < 64  # Adam's two moments (+ step counters)
  assert p["train"]["gradients (FP32 accumulator)"] == master
  # the sampler's weights, whole: E4M3 codes of every linear + FP32 scales per 128 x 128 tile, BF16 embed / head
  linears = matrices - 2 * V * D
  tiles = L * ((H * hd // 128) * (D // 128) * 2 + 2 * (K * hd // 128) * (D // 128) + 3 * (F // 128) * (D // 128))
  assert p["rollout"]["sampler weights"] == linears + 4 * tiles + 2 * (2 * V * D + norms)
  # one device's FP8 pool: 64 prompts / 8 devices of 512 tokens (4 pages of 128) + 512 / 8 slots of 3584 new tokens
  # (29 pages: one more for the position the last token is written at, one for the block it may straddle)
  pages = 8 * 4 + 64 * 29
  assert p["rollout"]["KV cache pool"] == pages * 128 * K * hd * 2 * L  # K and V, one byte each
  assert "fits 139.0 GiB" in p["verdict"]

  r, p = _plan_script("--devices=1", "--device_gib=139")
  assert r.returncode == 1
  assert p["state"]["master params (FP32)"] == 4 * (matrices + norms)
  assert "does not fit" in p["verdict"] and "mesh.fsdp" in p["verdict"] and "rollout phase" in p["verdict"]


def test_the_plan_is_what_the_trainer_holds(tmp_path):
  """On this machine's device: the plan's state rows are the bytes of the trainer's own state, its sampler weights
  the refit's, its KV pool the sampler's own accounting for the step's prompts."""
  config = small_config()
  t = RLTrainer(config, workdir=str(tmp_path))
  plan = t.memory_plan
  assert plan == memory_plan(config)
  assert plan.state["master params (FP32)"] == memory.tree_bytes(t.state.params) > 0
  assert plan.state["optimizer state"] == memory.tree_bytes(t.state.opt_state)
  assert plan.rollout["sampler weights"] == memory.tree_bytes(t.worker.refit(t.state.params))
  s, r = t.worker.sampler, config.rollout
  lay = s.layout(config.grpo.num_prompts, s.scfg.bucket(max(r.prompt_buckets)), r.max_new_tokens)
  assert plan.rollout["KV cache pool"] == s._pool_bytes(lay)


def test_a_run_that_cannot_fit_is_refused_before_any_weights(monkeypatch, tmp_path):
  """A device smaller than the run's exact needs: RLTrainer stops in its constructor, before initializing weights,
  naming the mesh keys; a device that holds it lets it start."""
  config = small_config()
  need = memory_plan(config).peak(exact_only=True)
  made = []
  monkeypatch.setattr(RLTrainer, "_init_state", lambda self: made.append(1))
  monkeypatch.setattr(memory, "device_limit", lambda: need - 1)
  with pytest.raises(ValueError, match=r"mesh\.fsdp") as e:
    RLTrainer(config, workdir=str(tmp_path))
  assert "rollout.slots" in str(e.value) or "train phase" in str(e.value)
  assert made == []
  monkeypatch.setattr(memory, "device_limit", lambda: need)
  RLTrainer(config, workdir=str(tmp_path))
  assert made == [1]


def test_tree_bytes_counts_each_devices_shard():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("fsdp",))
  x = jax.ShapeDtypeStruct((256, 8), np.float32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  assert memory.tree_bytes({"a": x, "b": jax.ShapeDtypeStruct((3,), np.int8)}) == 256 * 8 * 4 + 3


def test_measure_reads_the_state_and_each_step(tmp_path):
  """``memory.measure`` (``plan_memory.py --measure_steps``) on the CPU, the live arrays' bytes standing in for the
  GPU allocator: the state it reads holds at least the plan's state rows, the peaks grow through the first rollout
  and the steps, each step is a real RL step (sampler == trainer exactly on the CPU), and the worker is left as it
  was."""
  tr = RLTrainer(small_config(), str(tmp_path))
  peak = [0]

  def read(key):
    if key == "bytes_limit":
      return 24 * GIB
    now = sum(x.nbytes for x in jax.live_arrays())
    peak[0] = max(peak[0], now)
    return now if key == "bytes_in_use" else peak[0]

  got = memory.measure(tr, 2, read)
  assert got["state_in_use"] * GIB >= sum(tr.memory_plan.state.values())
  assert [s["step"] for s in got["steps"]] == [1, 2]
  assert got["state_in_use"] <= got["rollout_peak"] <= got["steps"][0]["peak"] <= got["steps"][1]["peak"]
  assert all(s["token_mult_prob_error"] == 1.0 and s["rollout_s"] > 0 for s in got["steps"]), got["steps"]
  assert "collect" not in vars(tr.worker)
  with pytest.raises(ValueError, match="allocator statistics"):
    memory.allocator_stats(jax.devices("cpu")[0])
