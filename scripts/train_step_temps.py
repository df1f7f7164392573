"""The train step's XLA temporaries per layer, compiled for the local device (no weights are made): the step for a
minibatch of --rows sequences of --seq tokens at depths 1 and 2 (--depths), and the difference (what each further
layer adds, which the memory plan extrapolates from). On a GPU this is the compiled program the run would execute.

  python scripts/train_step_temps.py --config=configs/llama8b_fp8_lora.py --rows=32 --seq=4096 \\
      [--noremat] [--config.grpo.microbatch=1] [--json=PATH]
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (configs/, fp8jax/)

import fp8jax  # noqa: E402

fp8jax.configure_xla()

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from fp8jax.diagnostics.provenance import provenance  # noqa: E402
from fp8jax.rl import memory, trainer  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
_ROWS = flags.DEFINE_integer("rows", 1, "Sequences in the minibatch (grpo.microbatch of them per microbatch).")
_SEQ = flags.DEFINE_integer("seq", 4096, "Tokens per sequence.")
_REMAT = flags.DEFINE_bool("remat", True, "model.remat.")
_DEPTHS = flags.DEFINE_list("depths", ["1", "2"], "Depths to compile (the first two give the per-layer figure; add the "
                            "model's own depth to see what the plan's affine extrapolation misses).")
_JSON = flags.DEFINE_string("json", None, "Also write the figures as JSON here.")


def main(_):
  c = _CONFIG.value
  c.unlock()
  c.model.remat = bool(_REMAT.value)
  c.checkpoint.hf_dir = ""  # the architecture from config.model (no download)
  learner = trainer.learner_from_config(c, jax.devices()[:1])
  out = {**provenance(), "rows": _ROWS.value, "seq": _SEQ.value, "microbatch": int(c.grpo.microbatch),
         "remat": bool(_REMAT.value), "temp_gib": {}}
  depths = [int(d) for d in _DEPTHS.value]
  if len(depths) < 2 or depths[0] >= depths[1]:
    raise app.UsageError(f"--depths={_DEPTHS.value}: give at least two increasing depths, e.g. 1,2")
  for depth in depths:
    t0 = time.perf_counter()
    a = memory.compile_train_step(learner.at_depth(depth), _ROWS.value, _SEQ.value)
    out["temp_gib"][depth] = a["temp"] / 2**30
    print(f"depth {depth}: {a['temp'] / 2**30:.3f} GiB of temporaries (compiled in {time.perf_counter() - t0:.0f} s)")
  d0, d1 = depths[:2]
  out["per_layer_gib"] = (out["temp_gib"][d1] - out["temp_gib"][d0]) / (d1 - d0)
  for d in depths[2:]:
    out.setdefault("extrapolated_gib", {})[d] = out["temp_gib"][d0] + (d - d0) * out["per_layer_gib"]
    print(f"depth {d}: compiled {out['temp_gib'][d]:.3f} GiB, extrapolated from depths {d0}, {d1}: "
          f"{out['extrapolated_gib'][d]:.3f} GiB")
  print(f"per layer: {out['per_layer_gib']:.3f} GiB ({_ROWS.value} x {_SEQ.value} tokens, microbatch "
        f"{out['microbatch']}, remat {out['remat']}, {out['device']})")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
