"""GRPO post-training in FP8: ``python scripts/train.py --config=configs/tiny_fp8.py [--config.x=y] [--workdir=DIR]``.

Thin entry point: parses flags, builds ``fp8jax.rl.trainer.RLTrainer`` and runs it. A mistyped override fails
(the config is locked).

One run per run directory: the run locks it (a second train.py on the same --workdir stops at once, naming the
process that holds it). By default a run resumes from the newest readable checkpoint in its workdir (a corrupt one
is set aside with a warning); metrics rows written after that checkpoint are dropped and written again.
``--noresume`` refuses a workdir that already holds a run, because starting over in place would mix the two (orbax
does not overwrite existing steps): give a new --workdir, or delete the old run's checkpoints/, metrics.jsonl and tb/.
Errors that stop a run (divergence, a locked or used workdir, a checkpoint made with another model shape) print one
message and exit with status 1. SIGTERM (a scheduler's preemption or time limit) finishes the RL step in flight,
saves its checkpoint and exits with status 143; the same command resumes there (single-process runs; a multi-process
run keeps SIGTERM's default and resumes from its last periodic checkpoint). Multi-process runs: the same command on
every process, with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set (fp8jax/distributed.py).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (configs/, fp8jax/)

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: config.workdir).")
_RESUME = flags.DEFINE_bool("resume", True, "Resume from the latest checkpoint in the workdir; --noresume refuses a "
                            "workdir that already holds a run (use a new --workdir to start over).")
_STEPS = flags.DEFINE_integer("steps", None, "Override the number of RL steps.")
_EXPORT = flags.DEFINE_string("export_dir", None, "After the run, write the policy here for transformers / PEFT / "
                              "vLLM: a LoRA run's adapters in PEFT's format, a full run's weights as HF safetensors.")
_MERGED = flags.DEFINE_enum("export_format", None, ["bf16", "fp8"], "With --export_dir: a LoRA run also writes the "
                            "merged model (export_dir/merged), a full run writes block FP8 with 'fp8' (default BF16).")


def main(argv):
  del argv
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/tiny_fp8.py")
  if _MERGED.value and not _EXPORT.value:
    raise app.UsageError("--export_format needs --export_dir (where to write the policy)")
  from fp8jax import distributed  # noqa: PLC0415

  distributed.initialize_from_env()  # multi-process runs (fp8jax/distributed.py); before any device is touched
  from fp8jax.checkpoint import CheckpointCorrupt, CheckpointUnreadable, WorkdirLocked  # noqa: PLC0415
  from fp8jax.metrics import read_jsonl  # noqa: PLC0415
  from fp8jax.rl.trainer import CheckpointMismatch, RLTrainer, RunDirInUse, TrainingDiverged  # noqa: PLC0415

  config = _CONFIG.value
  with config.unlocked():
    config.checkpoint.resume = bool(_RESUME.value) and config.checkpoint.resume
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    trainer = RLTrainer(config, _WORKDIR.value)
    if distributed.is_primary() and trainer._plan is not None:  # made where the device has a limit (a GPU)
      plan = trainer.memory_plan
      print(f"memory per device (plan, scripts/plan_memory.py): rollout {plan.phase('rollout') / 2**30:.2f} GiB, "
            f"train step {plan.phase('train') / 2**30:.2f} GiB with XLA's compiled temporaries")
    trainer.stop_on_signals()  # SIGTERM (a scheduler's preemption or time limit): finish the step, save, exit 143
    history = trainer.run(_STEPS.value)
    if _EXPORT.value and distributed.is_primary():
      trainer.export(_EXPORT.value, merged=_MERGED.value)
      print(f"exported the policy to {_EXPORT.value}")
  except (TrainingDiverged, WorkdirLocked, RunDirInUse, CheckpointMismatch, CheckpointCorrupt,
          CheckpointUnreadable) as e:
    sys.exit(f"error: {e}")
  if not distributed.is_primary():
    return  # process 0 wrote the metrics and prints the summary
  # The summary covers the whole run, also when this call resumed it (metrics.jsonl is appended to).
  path = os.path.join(trainer.workdir, "metrics.jsonl")
  rows = read_jsonl(path) if os.path.exists(path) else history
  first = next((h for h in rows if "val_accuracy" in h), {})
  last = next((h for h in reversed(rows) if "val_accuracy" in h), {})
  if not history:
    print(f"\nnothing to run: the checkpoint in {trainer.workdir} is already at the last step "
          "(--noresume starts over, --steps=N runs further)")
  print(f"\nrun directory: {trainer.workdir}")
  start = "after the warm start" if int(config.warmstart.steps) else "the starting model"
  print(f"validation accuracy: {first.get('val_accuracy', float('nan')):.3f} (step {first.get('step')}, {start}) -> "
        f"{last.get('val_accuracy', float('nan')):.3f} (step {last.get('step')})")
  print(f"metrics: {os.path.join(trainer.workdir, 'metrics.jsonl')}  plot: {os.path.join(trainer.workdir, 'metrics.png')}")
  if trainer.stop_reason is not None:
    print(f"stopped early by {trainer.stop_reason}: the same command resumes from the last checkpoint")
    sys.exit(128 + int(getattr(signal.Signals, trainer.stop_reason, signal.SIGTERM)))


if __name__ == "__main__":
  app.run(main)
