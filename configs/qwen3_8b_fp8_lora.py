"""Qwen3-8B GRPO with LoRA on a frozen block-FP8 base, on ONE 80 GB GPU: configs/llama8b_fp8_lora.py's recipe (rank 64
on all seven linears, lr 2e-5, 8 prompts x 16 samples of 512 + 3584 tokens, microbatch 1, FP8 KV cache) on Qwen3-8B's
architecture (36 layers, hidden 4096, 32 query / 8 KV heads of 128 with QK-norm, FFN 12288, vocabulary 151936,
untied head, rope_theta 1e6).

Run (after downloading the model and the prompts):
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python scripts/train.py --config=configs/qwen3_8b_fp8_lora.py \\
      --config.checkpoint.hf_dir=/models/Qwen3-8B --config.data.path=/data/prompts.jsonl
Hardware: one H100 80 GB or H200. Planned with `python scripts/plan_memory.py --config=configs/qwen3_8b_fp8_lora.py
--devices=1 --device_gib=76 --notemporaries` (CPU, the GPU's KV pages, 2026-12-08; exact rows, GiB per GPU): state
10.7 (FP8 base 8.79, FP32 adapters 0.65, Adam moments 1.30); rollout + 32.9 FP8 KV pool + 0.33 BF16 adapters = 44.0;
train step + 0.65 adapter gradients = 11.4. The train step's XLA temporaries come on top and are compiled for the GPU
when a run starts (the Llama twin's: 28.1 GiB at 4096-token sequences, microbatch 1,
docs/results/train_step_temps_lora8b_h100.json).
Measured: not yet run on a GPU.
"""

from configs import llama8b_fp8_lora


def get_config(arg=None):
  c = llama8b_fp8_lora.get_config(arg)
  c.workdir = "runs/qwen3_8b_fp8_lora"
  # Qwen3-8B's architecture (random-weight runs; with checkpoint.hf_dir it comes from config.json)
  c.model.update(dict(vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288,
                      norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, tie_embeddings=False, qk_norm=True))
  return c
