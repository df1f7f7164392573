"""The BF16 baseline of configs/smollm2_asdiv_fp8.py (same recipe, no quantization, BF16 KV cache).

Run: python scripts/train.py --config=configs/smollm2_asdiv_bf16.py
Expect a slow start: the checkpoint is BF16, so the FP32 master weights start exactly on the BF16 grid, and at this
recipe's learning rate (2e-6) the BF16 weights the sampler and trainer run receive ~2% of the first 10 steps' update
and ~34% of the first 100 (scripts/update_visibility.py). Measured (H100, 2026-12-06, 3 seeds): greedy validation
4.7% at the start, 4.2% at step 10, 4.4% at step 20 (docs/parity.md), while the FP8 recipe moved to 7.2% by step 10.
"""

from configs import common, smollm2_asdiv_fp8


def get_config(arg=None):
  return common.to_bf16(smollm2_asdiv_fp8.get_config(arg), "runs/smollm2_asdiv_bf16")
