"""scripts/update_visibility.py on a synthetic BF16 checkpoint: what reaches the BF16 and the block-FP8 weights."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_update_far_below_half_a_bf16_spacing_never_reaches_bf16_weights_and_a_large_one_does(tmp_path):
  rng = np.random.default_rng(0)
  w = (0.05 * rng.standard_normal((256, 384))).astype(ml_dtypes.bfloat16)  # a BF16 checkpoint: the master on its grid
  w[np.abs(w.astype(np.float32)) < 1e-3] = 1e-3  # no weight so small that 1e-9 would be half its BF16 spacing
  save_file({"model.layers.0.mlp.down_proj.weight": w}, str(tmp_path / "model.safetensors"))
  rows = {}
  for lr in (1e-9, 1e-2):
    out = tmp_path / f"vis{lr}.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "update_visibility.py"), "--hf_dir", str(tmp_path),
                    "--lr", str(lr), "--warmup", "1", "--steps", "1", "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    rows[lr] = json.loads(out.read_text())["rows"][0]
  small, large = rows[1e-9], rows[1e-2]
  assert small["bf16_changed_frac"] == 0 and small["bf16_update_arrived"] == 0
  # 1e-2 is many BF16 spacings (<= 2^-8 relative of |w| ~ 0.05) and many FP8 spacings: both pass it through
  assert abs(large["bf16_update_arrived"] - 1) < 0.05, large
  assert abs(large["fp8_update_arrived"] - 1) < 0.15, large
  assert large["bf16_changed_frac"] > 0.99
