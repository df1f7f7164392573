"""The BF16 baseline of configs/llama8b_fp8.py (same recipe, no quantization, BF16 KV cache).

Run: python scripts/train.py --config=configs/llama8b_bf16.py --config.checkpoint.hf_dir=... --config.data.path=...
"""

from configs import llama8b_fp8


def get_config(arg=None):
  c = llama8b_fp8.get_config(arg)
  c.workdir = "runs/llama8b_bf16"
  c.fp8.mode = "bf16"
  c.fp8.kv_cache = "bf16"
  return c
