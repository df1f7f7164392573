"""The BF16 baseline of configs/llama8b_fp8_lora.py: LoRA on a frozen BF16 base (15.0 GiB instead of 8.5 of FP8 codes),
BF16 KV cache, and 64 decode slots instead of 128 (the paged KV pool scales with the slots: 58.5 GiB of BF16 pages at
128 slots, 75.6 GiB with the state: no room left for XLA's temporaries on an 80 GB card); the same batch, everything
else identical.

Run: python scripts/train.py --config=configs/llama8b_bf16_lora.py --config.checkpoint.hf_dir=... --config.data.path=...
Hardware: one H100 80 GB. Planned with `python scripts/plan_memory.py --config=configs/llama8b_bf16_lora.py
--devices=1 --device_gib=76 --notemporaries` (CPU, the GPU's KV pages, 2026-12-08; exact rows, GiB per GPU): state 16.8
(BF16 base 14.96, FP32 adapters 0.62, Adam moments 1.25); rollout + 29.5 BF16 KV pool + 0.31 BF16 adapters = 46.6;
train step + 0.62 adapter gradients = 17.5, XLA's temporaries on top (configs/llama8b_fp8_lora.py). Measured beside
the FP8 twin on one H200 (configs/llama8b_fp8_lora.py; docs/results/lora8b_grpo_step_h200.json): 68.9 s per step at
4 x 8 sequences of 4096 tokens, peak 49.8 GiB (plan 53.9).
"""

from configs import common, llama8b_fp8_lora


def get_config(arg=None):
  c = common.to_bf16(llama8b_fp8_lora.get_config(arg), "runs/llama8b_bf16_lora")
  c.rollout.slots = 64  # the BF16 KV pool is twice the FP8 one per slot (docstring)
  return c
