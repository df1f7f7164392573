"""The BF16 baseline of configs/qwen3_30b_a3b_fp8.py (same recipe, no quantization, BF16 KV cache).

Run: python scripts/train.py --config=configs/qwen3_30b_a3b_bf16.py \
      --config.checkpoint.hf_dir=/models/Qwen3-30B-A3B --config.data.path=/data/openmathinstruct2.jsonl
Hardware: 8x H200, as the FP8 recipe. On a GPU the BF16 GEMMs run the batch-invariant BF16 Hopper kernel, the experts
its grouped mode (forward, dgrad) and the grouped BF16 wgrad kernel. The full recipe has not been run; 2 layers
at the GRPO smoke shape: 0.373 s per step on one H200 (docs/performance.md).
"""

from configs import common, qwen3_30b_a3b_fp8


def get_config(arg=None):
  return common.to_bf16(qwen3_30b_a3b_fp8.get_config(arg), "runs/qwen3_30b_a3b_bf16")
