"""The BF16 baseline of configs/qwen3_8b_fp8_lora.py: LoRA on a frozen BF16 base, BF16 KV cache, 64 decode slots
instead of 128 (the BF16 KV pool is twice the FP8 one per slot, as in configs/llama8b_bf16_lora.py); the same batch.

Run: python scripts/train.py --config=configs/qwen3_8b_bf16_lora.py --config.checkpoint.hf_dir=DIR --config.data.path=F
Planned as its FP8 twin's docstring says (GiB per GPU): state 17.2 (BF16 base 15.26); rollout + 33.2 BF16 KV pool at 64
slots + 0.33 = 50.7; train step 17.9, XLA's temporaries on top. Not yet run on a GPU.
"""

from configs import common, qwen3_8b_fp8_lora


def get_config(arg=None):
  c = common.to_bf16(qwen3_8b_fp8_lora.get_config(arg), "runs/qwen3_8b_bf16_lora")
  c.rollout.slots = 64
  return c
