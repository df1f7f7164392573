"""The BF16 baseline of configs/llama8b_fp8.py (same recipe, no quantization, BF16 KV cache).

Run: python scripts/train.py --config=configs/llama8b_bf16.py --config.checkpoint.hf_dir=... --config.data.path=...
"""

from configs import common, llama8b_fp8


def get_config(arg=None):
  return common.to_bf16(llama8b_fp8.get_config(arg), "runs/llama8b_bf16")
