"""BF16 vs FP8 end to end vs FP8 in generation only, GRPO from one shared warm start (issue 18; docs/parity.md).

  .venv/bin/python scripts/parity.py --smoke                       # one seed, 3 small steps, every arm: minutes on CPU
  .venv/bin/python scripts/parity.py --seeds=3 --steps=200         # the table: docs/results/parity.json + .png
  .venv/bin/python scripts/parity.py --arms=bf16,fp8,fp8_rollout_tis --difficulty=6 --config.model.n_layers=4
  .venv/bin/python scripts/parity.py --warm_start_only; for a in bf16 fp8 ...; do for s in 0 1 2; do  # in parallel
    .venv/bin/python scripts/parity.py --arms=$a --seeds=1 --first_seed=$s --out=runs/parity/$a$s.json & done; done
  wait; .venv/bin/python scripts/parity.py --table_only    # reads the finished runs, writes the table
  # a pretrained model (warmstart.steps = 0, e.g. configs/smollm2_asdiv_fp8.py): no warm start to share; each arm x
  # seed is a scripts/train.py run from the checkpoint, with the arm's flags (--arm_flags prints them)
  for a in bf16 fp8 fp8_rollout fp8_rollout_tis; do for s in 0 1 2; do
    .venv/bin/python scripts/train.py --config=configs/smollm2_asdiv_fp8.py --workdir=runs/parity_smollm2/$a/seed$s \
      --steps=50 --config.train.val_every=5 --config.rollout.seed=$s $(.venv/bin/python scripts/parity.py \
      --arm_flags=$a) & done; done
  wait; .venv/bin/python scripts/parity.py --config=configs/smollm2_asdiv_fp8.py --workdir=runs/parity_smollm2 \
    --table_only --steps=50 --val_every=5 --out=parity_smollm2.json

Thin entry point over ``fp8jax.diagnostics.parity``: one BF16 warm start (trained once, checkpointed under
``--workdir``/warmstart and reused by later invocations with the same settings), then every arm x seed from it, each
run in ``--workdir``/<arm>/seed<k> (a rerun resumes finished or interrupted runs). Prints the table and writes it
to ``--out`` (JSON) and the validation curves to ``--png``. ``--config.x=y`` overrides the base config (locked: a
mistyped key fails); the arms override ``fp8.mode`` and the ``grpo`` correction keys on top.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (configs/, fp8jax/)

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from fp8jax.diagnostics import parity  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_fp8.py", "Base config (configs/*.py).",
                                          lock_config=True)
_ARMS = flags.DEFINE_list("arms", list(parity.ARMS), f"Arms to run, of {list(parity.ARMS)}.")
_SEEDS = flags.DEFINE_integer("seeds", None, "RL seeds per arm (rollout.seed = 0..N-1); default 3, --smoke 1.")
_FIRST_SEED = flags.DEFINE_integer("first_seed", 0, "The first RL seed: runs seeds first_seed .. first_seed + "
                                   "seeds - 1 (one seed per process, for parallel runs).")
_STEPS = flags.DEFINE_integer("steps", None, "RL steps per run; default the config's train.steps, --smoke "
                              f"{parity.SMOKE_STEPS}.")
_VAL_EVERY = flags.DEFINE_integer("val_every", None, "Validate every N RL steps (and at the last); default the "
                                  f"config's train.val_every, --smoke {parity.SMOKE_VAL_EVERY}.")
_DIFFICULTY = flags.DEFINE_integer("difficulty", None, "arithmetic.difficulty (fp8jax.rl.tasks.DIFFICULTY); default "
                                   "the config's.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny preset: short warm start, small batches, 1 seed, few steps; writes "
                           "under runs/parity_smoke unless --out/--png/--workdir say otherwise.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Runs and the warm start (default runs/parity, --smoke "
                               "runs/parity_smoke).")
_OUT = flags.DEFINE_string("out", None, "JSON table (default docs/results/parity.json; --smoke: in --workdir).")
_PNG = flags.DEFINE_string("png", None, "PNG of the validation curves (default: --out with .png).")
_WARM_ONLY = flags.DEFINE_bool("warm_start_only", False, "Train (or find) the shared warm start in --workdir and "
                                "exit. Arms can then run in parallel processes (--arms=<one>), and a last invocation "
                                "over all arms writes the table from the finished runs.")
_TABLE_ONLY = flags.DEFINE_bool("table_only", False, "Train nothing: write the table from the finished runs in "
                                 "--workdir (e.g. run in parallel processes); an unfinished run is an error.")
_ARM_FLAGS = flags.DEFINE_string("arm_flags", None, "Print an arm's scripts/train.py flags (its config overrides, "
                                  "e.g. --config.fp8.mode=bf16 --config.fp8.kv_cache=bf16) and exit.")
_CACHE = flags.DEFINE_bool("compile_cache", None, "XLA's persistent compilation cache in --workdir/xla_cache, so "
                           "arms with the same programs compile once (default: off; XLA:CPU segfaulted with it on "
                           "in MoE train-step compiles: tests/conftest.py).")


def main(argv):
  del argv
  import jax  # noqa: PLC0415

  if _ARM_FLAGS.value is not None:
    arm = _ARM_FLAGS.value
    if arm not in parity.ARMS:
      raise app.UsageError(f"--arm_flags={arm!r}: not among {list(parity.ARMS)}")
    print(" ".join(f"--config.{k}={v}" for k, v in parity.ARMS[arm].items()))
    return
  c = _CONFIG.value
  smoke = _SMOKE.value
  if smoke:
    c = parity.override(c, parity.SMOKE)
  if _DIFFICULTY.value is not None:
    c = parity.override(c, {"arithmetic.difficulty": _DIFFICULTY.value})
  workdir = _WORKDIR.value or ("runs/parity_smoke" if smoke else "runs/parity")
  out = _OUT.value or (os.path.join(workdir, "parity.json") if smoke else "docs/results/parity.json")
  png = _PNG.value or os.path.splitext(out)[0] + ".png"
  steps = _STEPS.value if _STEPS.value is not None else (parity.SMOKE_STEPS if smoke else int(c.train.steps))
  val_every = _VAL_EVERY.value or (parity.SMOKE_VAL_EVERY if smoke else int(c.train.val_every))
  seeds = _SEEDS.value if _SEEDS.value is not None else (1 if smoke else 3)
  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.join(workdir, "xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  logging.set_verbosity(logging.WARNING)
  if _WARM_ONLY.value:
    _, info = parity.warm_start(c, os.path.join(workdir, "warmstart"))
    print(f"warm start in {os.path.join(workdir, 'warmstart')}: greedy validation accuracy {info['val_accuracy']:.3f}")
    return
  result = parity.run_parity(c, arms=parity.check_arms(_ARMS.value), seeds=seeds, steps=steps, val_every=val_every,
                             workdir=workdir, out_json=out, out_png=png, command=" ".join(sys.argv),
                             first_seed=_FIRST_SEED.value, table_only=_TABLE_ONLY.value)
  print()
  print(parity.format_table(result))
  print(f"\ntable: {out}  curves: {png}")


if __name__ == "__main__":
  app.run(main)
