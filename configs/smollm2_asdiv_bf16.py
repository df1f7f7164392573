"""The BF16 baseline of configs/smollm2_asdiv_fp8.py (same recipe, no quantization, BF16 KV cache).

Run: python scripts/train.py --config=configs/smollm2_asdiv_bf16.py
"""

from configs import common, smollm2_asdiv_fp8


def get_config(arg=None):
  return common.to_bf16(smollm2_asdiv_fp8.get_config(arg), "runs/smollm2_asdiv_bf16")
