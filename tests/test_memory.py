"""The per-device memory plan (fp8jax/rl/memory.py, scripts/plan_memory.py) against sizes derived independently, and
the trainer's refusal of a run that cannot fit."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from fp8jax.rl import memory
from fp8jax.rl.trainer import RLTrainer, memory_plan
from test_trainer import small_config, small_flags

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
  r, p = _plan_script("--devices=8", "--device_gib=139", "--notemporaries")
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

  r, p = _plan_script("--devices=1", "--device_gib=139", "--notemporaries")
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


# scripts/plan_memory.py on a stand-in GPU: a device limit to check against, the live arrays' bytes for the
# allocator's statistics; prints how often each of the run's programs was compiled.
_STAND_IN_GPU = """
import json, logging, runpy, sys
import jax
from fp8jax.rl import memory
memory.device_limit = lambda: 64 * memory.GIB
peak = [0]
def read(key):
  if key == "bytes_limit":
    return 64 * memory.GIB
  now = sum(x.nbytes for x in jax.live_arrays())
  peak[0] = max(peak[0], now)
  return now if key == "bytes_in_use" else peak[0]
memory.allocator_stats = lambda device=None: read
seen = set()
class Compiles(logging.Handler):
  def emit(self, record):
    seen.add(record.getMessage())
logging.getLogger().addHandler(Compiles())
jax.config.update("jax_log_compiles", True)
sys.argv = ["plan_memory.py", *sys.argv[1:]]
try:
  runpy.run_path("scripts/plan_memory.py", run_name="__main__")
finally:
  print("COMPILES " + json.dumps({n: sum(f"Finished XLA compilation of jit({n})" in m for m in seen)
                                  for n in ("train_step", "_prefill_fn", "_decode_fn")}))
"""


def test_measure_steps_plans_with_the_runs_own_check_and_compiles_each_program_once(tmp_path):
  """``plan_memory.py --measure_steps`` on a stand-in GPU: the plan it prints is the trainer's own check (the
  programs at full depth), so the measured step compiles no train step or decode loop again (one prefill more: the
  BF16-cache calibration of the FP8 KV scales); its JSON holds the plan and the measured step."""
  out = tmp_path / "plan.json"
  r = subprocess.run([sys.executable, "-c", _STAND_IN_GPU, *small_flags(**{"model.n_layers": 3}),
                      "--measure_steps=1", f"--json={out}"], cwd=REPO, capture_output=True, text=True, timeout=600,
                     env={**os.environ, "PYTHONPATH": REPO})
  assert r.returncode == 0, r.stderr[-3000:]
  compiles = json.loads(r.stdout.split("COMPILES ")[-1])
  assert compiles == {"train_step": 1, "_prefill_fn": 2, "_decode_fn": 1}, compiles
  got = json.loads(out.read_text())
  assert got["compiled"]["train_step"]["depths"] == [3]
  assert got["measured"]["steps"][0]["token_mult_prob_error"] == 1.0
  assert "planned vs measured" in r.stdout


def test_the_plan_adds_the_compiled_programs_temporaries_extrapolated_in_depth(monkeypatch):
  """The plan's XLA rows are the memory analyses of the run's own train step, prefill and decode loop compiled for
  this backend (here XLA:CPU; on a GPU the GPU's), 3 layers deep extrapolated from 1 and 2 layers: within 5% of the
  same programs compiled 3 deep (measured on XLA:CPU: 0.6% train step, 1.7% prefill, 1.3% decode; buffer
  assignment is not exactly affine in the depth). Planning GPUs on the CPU (target="gpu") shows them unchecked."""
  config = small_config(**{"model.n_layers": 3})
  plan = memory_plan(config)
  c = plan.compiled
  assert c["backend"] == jax.default_backend() and plan.estimates == ()
  assert [c[k]["depths"] for k in ("train_step", "prefill", "decode")] == [[1, 2]] * 3
  grads = plan.train["gradients (FP32 accumulator)"]
  assert c["train_step"]["temp"] > grads == plan.state["master params (FP32)"]  # the accumulator is a temporary
  assert plan.train[memory.TRAIN_TEMPS] == c["train_step"]["temp"] - grads
  assert plan.rollout[memory.ROLLOUT_TEMPS] == max(c["prefill"]["temp"],
                                                   c["decode"]["temp"] + c["decode"]["state_beyond_pool"])
  monkeypatch.setattr(memory, "compiled_depths", lambda n, alike: (n,))
  direct = memory_plan(config).compiled
  for k in ("train_step", "prefill", "decode"):
    assert direct[k]["depths"] == [3]
    assert abs(c[k]["temp"] - direct[k]["temp"]) <= 0.05 * direct[k]["temp"], (k, c[k]["temp"], direct[k]["temp"])
    assert c[k]["argument"] == direct[k]["argument"]  # weights and state: exactly affine in the depth
  gpu = memory_plan(config, target="gpu")
  assert set(gpu.estimates) == {memory.TRAIN_TEMPS, memory.ROLLOUT_TEMPS}
  memory.check(gpu, gpu.peak(exact_only=True))  # the CPU's temporaries are not held against a GPU


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_runs_own_check_compiles_the_programs_the_run_then_executes(lora, monkeypatch, tmp_path, caplog):
  """Where the trainer checks its plan against a device's limit (a GPU's allocator; here a stand-in limit on the
  CPU), the train step, prefill and decode loop are compiled at the run's full depth, not extrapolated from depths 1
  and 2, and those compiles are the run's: its first RL step compiles no train step or decode loop again, and one
  prefill only (the BF16-cache prefill that calibrates the FP8 KV scales, once per run; the rollout's prefill is
  the plan's). JAX's in-memory cache reuses a program only if the plan's abstract arguments lower exactly as the
  run's arrays (shapes, shardings, static arguments; with LoRA the sampler's weights are the frozen base with BF16
  adapters). The log that shows the plan's compiles is the one that shows none in the step, so the check can
  fail."""
  lora_keys = {"lora.rank": 8, "lora.alpha": 16.0, "warmstart.steps": 0} if lora else {}
  monkeypatch.setattr(memory, "device_limit", lambda: 64 * GIB)

  def compiles(name):  # distinct compiles (JAX logs each from two places, with its time)
    return len({r.getMessage() for r in caplog.records
                if f"Finished XLA compilation of jit({name})" in r.getMessage()})

  jax.clear_caches()  # programs another test of this process compiled would be found, not compiled, by the plan
  with jax.log_compiles(True), caplog.at_level("WARNING"):
    tr = RLTrainer(small_config(**{"model.n_layers": 3, **lora_keys}), str(tmp_path))
    assert tr.memory_plan.compiled["train_step"]["depths"] == [3]
    assert tr.memory_plan.compiled["decode"]["depths"] == tr.memory_plan.compiled["prefill"]["depths"] == [3]
    planned = [compiles(n) for n in ("train_step", "_prefill_fn", "_decode_fn")]
    caplog.clear()
    m = tr.step(0)
    again = [compiles(n) for n in ("train_step", "_prefill_fn", "_decode_fn")]
  assert planned == [1, 1, 1], planned
  assert again == [0, 1, 0], again
  assert m["token_mult_prob_error"] == 1.0


def test_a_refusal_names_the_keys_that_shrink_the_phase(monkeypatch):
  """check's message for each phase names the config keys that shrink it (a plan of made-up sizes), and where the
  device's limit comes from (the allocator's share, several processes on one GPU set it lower)."""
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  g = GIB
  p = memory.MemoryPlan(mesh={"fsdp": 1}, state={"master params (FP32)": 30 * g, "optimizer state": 60 * g},
                        rollout={"sampler weights": 9 * g, "KV cache pool": 10 * g},
                        train={"gradients (FP32 accumulator)": 30 * g, memory.TRAIN_TEMPS: 40 * g}, kv_cache="fp8")
  with pytest.raises(ValueError, match="train phase") as e:
    memory.check(p, 139 * g)
  for key in ("mesh.fsdp", "optim.state_dtype", "optim.offload", "grpo.microbatch", "model.remat", "lora.rank"):
    assert key in str(e.value), key
  memory.check(p, 160 * g)
  p = dataclasses.replace(p, rollout={"sampler weights": 9 * g, "KV cache pool": 70 * g})
  with pytest.raises(ValueError, match="rollout phase") as e:
    memory.check(p, 160 * g)
  assert "rollout.slots" in str(e.value) and "grpo.num_prompts" in str(e.value)
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's default 0.75" in str(e.value)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.155")
  with pytest.raises(ValueError, match=r"may use: XLA_PYTHON_CLIENT_MEM_FRACTION=0\.155\)"):
    memory.check(p, 160 * g)


def test_offload_moves_the_state_rows_to_host_memory():
  """optim.offload: the master and the moments are host rows, not the device's; BF16 moments are half of FP32's."""
  base = memory_plan(small_config(), temporaries=False)
  off = memory_plan(small_config(**{"optim.offload": "pinned_host", "optim.state_dtype": "bfloat16"}),
                    temporaries=False)
  assert "master params (FP32)" not in off.state and "optimizer state" not in off.state
  assert off.host["master params (FP32) (pinned_host)"] == base.state["master params (FP32)"]
  moments = base.state["optimizer state"] - 8  # two int32 step counts (Adam's, the schedule's)
  assert off.host["optimizer state (pinned_host)"] - 8 == moments // 2
  assert off.peak() == base.peak() - sum(base.state.values())


def test_the_scoring_passes_fit_in_the_train_steps_room():
  """The mismatch / recompute / reference log-prob passes run grpo.microbatch sequences per call
  (``Learner.batch_logprobs``): the plan holds no row for them because one such call, a forward pass, needs less than
  the train step over a microbatch of the same shape (forward, backward, gradients), which the plan holds. (One call
  over the whole rollout batch did not fit on the GPU past an accepting plan.)"""
  from test_learner import _learner  # noqa: PLC0415

  lr = _learner(4)
  rows, seq = 64, 64
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lr.abstract_state(kv=True, ref=False).params)
  kv = tuple(jax.ShapeDtypeStruct((lr.cfg.n_layers,), np.float32) for _ in range(2))

  def scoring(n):
    tokens = jax.ShapeDtypeStruct((n, seq), np.int32)
    return memory.memory_analysis(lr.logprobs.lower(params, tokens, kv_scales=kv).compile())["temp"]

  train = memory.compile_train_step(lr, rows, seq)["temp"]
  assert 0 < scoring(4) <= train
  assert scoring(rows) > train  # the whole batch at once: more than the room the plan holds (XLA:CPU: 1.8x)
