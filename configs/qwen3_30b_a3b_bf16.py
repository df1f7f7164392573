"""The BF16 baseline of configs/qwen3_30b_a3b_fp8.py (same recipe, no quantization, BF16 KV cache).

Run: python scripts/train.py --config=configs/qwen3_30b_a3b_bf16.py \
      --config.checkpoint.hf_dir=/models/Qwen3-30B-A3B --config.data.path=/data/openmathinstruct2.jsonl
Hardware: 8x H200, as the FP8 recipe (in BF16 mode every GEMM, the grouped expert GEMMs included, is an XLA dot: no
kernel is missing). Not run yet; nothing measured.
"""

from configs import common, qwen3_30b_a3b_fp8


def get_config(arg=None):
  return common.to_bf16(qwen3_30b_a3b_fp8.get_config(arg), "runs/qwen3_30b_a3b_bf16")
