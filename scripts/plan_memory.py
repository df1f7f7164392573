"""A run's memory per device, from its config alone: ``python scripts/plan_memory.py --config=configs/llama8b_fp8.py
--devices=8 [--device_gib=139] [--config.x=y] [--json=PATH]``.

No weights are made and no task or data is read (``fp8jax.rl.trainer.memory_plan``; rows and their exactness:
``fp8jax/rl/memory.py``). ``--devices=N`` plans for a mesh of N GPUs on this machine's CPU (N fake host devices, so
no GPU is needed, and the GPU kernels' 128-position KV pages; the mesh comes from the config's ``mesh`` group as in a
run); without it, for the local devices.
The plan is checked as ``RLTrainer`` checks it before making weights, against ``--device_gib`` (e.g. 139 for an H200's
usable memory) or the local device's own limit: the exit status is 1 and the message names the keys to change when
the run would not fit.

``--measure_steps=N`` (on a GPU) then runs the config's first N RL steps on the local device and prints, beside the
plan, what the allocator saw: the bytes held once the state is made (before the first step), the peak through
the first rollout (read when its tokens reach the host) and the peak through the whole step. The plan is then the
run's own check (``RLTrainer`` plans before making weights), so its full-depth programs are compiled once, for the
plan and the measured steps alike. The plan's phases include the temporaries of the run's programs compiled for this
GPU (``--notemporaries`` leaves them out), so the difference is what the plan misses: the programs' code,
fragmentation, buffers alive across programs. Random weights need a task that needs no download, e.g.
``--config.task=arithmetic``; ``--config.model.n_layers`` makes the check fit one GPU. ``--device_gib`` is for plans
only (a measurement holds the device to its own limit).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (configs/, fp8jax/)


def _fake_devices(argv) -> int | None:
  """--devices=N from the command line, read before jax is imported (XLA reads its flags then)."""
  for i, a in enumerate(argv):
    if a.startswith("--devices="):
      return int(a.split("=", 1)[1])
    if a == "--devices" and i + 1 < len(argv):
      return int(argv[i + 1])
  return None


_N = _fake_devices(sys.argv)
if _N:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_N}".strip()

import contextlib  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
flags.DEFINE_integer("devices", None, "Plan for N fake CPU devices (default: this machine's devices).")
_GIB = flags.DEFINE_float("device_gib", None, "Memory per device to check against, GiB (default: the local "
                          "device's limit; none on CPU).")
_JSON = flags.DEFINE_string("json", None, "Also write the plan as JSON here.")
_TEMPS = flags.DEFINE_bool("temporaries", None, "Compile the train step, prefill and decode loop at the run's shapes "
                           "for XLA's temporaries (fp8jax/rl/memory.py). Default: on for the local devices, off with "
                           "--devices (XLA:CPU's temporaries are not a GPU's, and the GPU's KV page layout does not "
                           "compile on the CPU reference).")
_MEASURE = flags.DEFINE_integer("measure_steps", 0, "Then run this many RL steps on the local device and print the "
                                "allocator's figures beside the plan (a GPU; see the module docstring).")


def main(argv):
  del argv
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/llama8b_fp8.py")
  if _MEASURE.value and _N:
    raise app.UsageError("--measure_steps runs on the local devices: leave out --devices")
  from fp8jax.rl import memory  # noqa: PLC0415
  from fp8jax.rl.trainer import RLTrainer, memory_plan  # noqa: PLC0415

  temporaries = _TEMPS.value if _TEMPS.value is not None else not _N
  if temporaries and _N:
    raise app.UsageError("--temporaries with --devices: XLA's temporaries come from compiling on the GPU the plan is "
                         "for (run without --devices there); the CPU cannot compile the GPU's KV page layout")
  own = None if _N else memory.device_limit()  # this process's GPU: the programs compiled as the run will (full depth)
  # Measuring with the temporaries: the plan is the run's own check (RLTrainer plans and checks before making weights),
  # so the full-depth programs are compiled once, for the plan and the measured steps alike.
  own_check = bool(_MEASURE.value) and temporaries
  if own_check and _GIB.value:
    raise app.UsageError("--measure_steps measures the local device against its own limit: leave out --device_gib")
  read = None
  if _MEASURE.value:  # a device without allocator statistics stops here, before any compile or weights
    try:
      read = memory.allocator_stats()
    except ValueError as e:
      raise app.UsageError(f"--measure_steps: {e}") from e
  with contextlib.ExitStack() as stack:
    build = lambda: RLTrainer(_CONFIG.value, stack.enter_context(tempfile.TemporaryDirectory()))  # noqa: E731
    trainer = None
    if own_check:
      try:
        trainer = build()
        plan = trainer.memory_plan
      except memory.DoesNotFit as e:
        plan = e.plan
    else:  # planning GPUs on the CPU: the GPU kernels' KV pages (128 positions; the CPU reference's are 16)
      from fp8jax import kvcache  # noqa: PLC0415

      with kvcache.gpu_pages() if _N else contextlib.nullcontext():
        plan = memory_plan(_CONFIG.value, temporaries=temporaries, target="gpu" if _N else None,
                           full_depth=own is not None)
    limit = int(_GIB.value * memory.GIB) if _GIB.value else own
    print(plan.table())
    verdict, fits = ("no limit to check against (CPU: pass --device_gib)" if limit is None else None), True
    try:
      memory.check(plan, limit)
    except memory.DoesNotFit as e:
      verdict, fits = f"does not fit: {e}", False
    exact = plan.peak(exact_only=True) / memory.GIB
    unchecked = ("XLA's temporaries not compiled (--notemporaries)" if not plan.compiled else
                 f"XLA's temporaries compiled for {plan.compiled['backend']}, not checked" if plan.estimates else
                 f"XLA's temporaries compiled for {plan.compiled['backend']} included")
    verdict = verdict or f"fits {limit / memory.GIB:.1f} GiB per device (checked part {exact:.1f} GiB; {unchecked})"
    print(verdict)
    result = dict(plan.to_json(), limit=limit, verdict=verdict)
    if _MEASURE.value and fits:
      got = memory.measure(trainer or build(), _MEASURE.value, read)
      result["measured"] = got
      g = memory.GIB
      c = plan.compiled
      if c:
        print(f"\nXLA's compiled programs ({c['backend']}), GiB per device: " + ", ".join(
            f"{name} temp {c[name]['temp'] / g:.2f} (depths {c[name]['depths']})" for name in ("train_step", "prefill",
                                                                                                "decode")))
      rows = [("state, before the first step", sum(plan.state.values()) / g, got["state_in_use"]),
              ("peak through the first rollout", plan.phase("rollout") / g, got["rollout_peak"]),
              ("peak through step 1 (rollout + train)", plan.peak() / g, got["steps"][0]["peak"])]
      print(f"\nplanned vs measured, GiB (allocator limit {got['limit']:.1f} GiB):")
      print(f"  {'':40s} {'planned':>9s} {'measured':>9s} {'measured - planned':>19s}")
      for name, planned, measured in rows:
        print(f"  {name:40s} {planned:9.2f} {measured:9.2f} {measured - planned:19.2f}")
      for s in got["steps"]:
        print(f"  step {s['step']}: peak {s['peak']:.2f} GiB, {s['step_s']:.1f} s (rollout {s['rollout_s']:.1f} s, "
              f"train {s['train_s']:.1f} s), token_mult_prob_error {s['token_mult_prob_error']}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=1)
  return 0 if fits else 1


if __name__ == "__main__":
  app.run(main)
