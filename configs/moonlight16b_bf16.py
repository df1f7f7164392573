"""The BF16 baseline of configs/moonlight16b_fp8.py (same recipe, no quantization, BF16 latent KV cache).

Run: python scripts/train.py --config=configs/moonlight16b_bf16.py \
      --config.checkpoint.hf_dir=/models/Moonlight-16B-A3B-Instruct --config.data.path=/data/openmathinstruct2.jsonl
Hardware: 8x H200, as the FP8 recipe (its attention caveat applies here too). The full recipe has not been run; 2
layers at the GRPO smoke shape: 0.300 s per step on one H200, token_mult_prob_error 1.0 (docs/performance.md).
"""

from configs import common, moonlight16b_fp8


def get_config(arg=None):
  return common.to_bf16(moonlight16b_fp8.get_config(arg), "runs/moonlight16b_bf16")
