"""The BF16 baseline of configs/tiny_moe_fp8.py: identical except the recipe (no quantization, BF16 KV cache).

Run: .venv/bin/python scripts/train.py --config=configs/tiny_moe_bf16.py
"""

from configs import common, tiny_moe_fp8


def get_config(arg=None):
  return common.to_bf16(tiny_moe_fp8.get_config(arg), "runs/tiny_moe_bf16")
