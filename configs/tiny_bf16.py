"""The BF16 baseline of configs/tiny_fp8.py: identical except the recipe (no quantization, BF16 KV cache).

Run: .venv/bin/python scripts/train.py --config=configs/tiny_bf16.py
"""

from configs import tiny_fp8


def get_config(arg=None):
  c = tiny_fp8.get_config(arg)
  c.workdir = "runs/tiny_bf16"
  c.fp8.mode = "bf16"
  c.fp8.kv_cache = "bf16"
  return c
