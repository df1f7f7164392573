"""The BF16 baseline of configs/smollm2_asdiv_fp8.py (same recipe, no quantization, BF16 KV cache).

Run: python scripts/train.py --config=configs/smollm2_asdiv_bf16.py
Measured (H100 80GB, 2026-12-07, 3 seeds, this schedule: lr 3e-5, 40 steps): greedy validation 4.7% -> 15.1% +- 2.0
(docs/parity.md). At lr 2e-6 the BF16 weights barely move in the first 20 steps (the checkpoint sits on
the BF16 grid: configs/smollm2_asdiv_fp8.py says why).
"""

from configs import common, smollm2_asdiv_fp8


def get_config(arg=None):
  return common.to_bf16(smollm2_asdiv_fp8.get_config(arg), "runs/smollm2_asdiv_bf16")
