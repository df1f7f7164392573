"""Llama-3.1-8B-Instruct GRPO with LoRA on a frozen block-FP8 base, on ONE 80 GB H100 (configs/llama8b_fp8.py's
recipe and data; fp8jax.lora).

Run (after downloading the model and the prompts):
  python scripts/train.py --config=configs/llama8b_fp8_lora.py \
      --config.checkpoint.hf_dir=/models/Llama-3.1-8B-Instruct --config.data.path=/data/openmathinstruct2.jsonl
Hardware: one H100 80 GB (mesh fsdp=1). Full-parameter training cannot fit one GPU (FP32 master + Adam moments are 12
bytes per parameter, 96 GB at 8B), so the base stays block-FP8 codes + scales (the sampler's and the trainer's one
copy, no master) and only the adapters train: rank 64 on all seven linears of the 32 layers, 168M parameters (2.1%),
whose FP32 master, gradients and Adam moments take ~2.5 GB.
Rank 64 / alpha 128: alpha / r = 2 keeps the adapters' update scale at the value common in LoRA RL recipes (PEFT's
examples and LoRA-for-GRPO reports use alpha = 2r); rank 64 is where LoRA on all linears tracks full fine-tuning on
math RL ("LoRA without regret", Thinking Machines 2025: RL needs very little capacity), at 2.5 GB.
lr 2e-5 (constant after a 10-step warmup): LoRA's optimal LR is ~10x full fine-tuning's (ibid.; llama8b_fp8.py's full
recipe uses 5e-7 with a larger batch), in the 1e-5..5e-5 range of LoRA GRPO recipes.
Batch: 8 prompts x 16 generations of 512 + 3584 tokens, microbatch 1, 128 decode slots, sized by
`python scripts/plan_memory.py --config=configs/llama8b_fp8_lora.py --devices=1 --device_gib=76 --notemporaries`
(CPU, the GPU's 128-position KV pages, 2026-12-08). Its exact rows, GiB per GPU: state 10.3 (FP8 base 8.46, FP32
adapters 0.62, Adam moments 1.25); rollout + 29.3 FP8 KV pool + 0.31 BF16 adapters = 39.9; train step + 0.62 adapter
gradients = 11.0. XLA's temporaries come on top; on a GPU the trainer compiles the run's programs for them before
making weights (XLA:CPU's are no guide to the GPU's).
Measured on one H100 80 GB (2026-12-06, random weights, 32 layers, 4096-token sequences): the trainer's own plan,
which on a GPU compiles the train step for XLA's temporaries, refused microbatch 2 before making weights: 59.5 GiB
of temporaries, 70.5 GiB in the train phase against the 59.4 GiB JAX takes by default (75% of the card; BF16 LoRA:
84.0 GiB). Hence microbatch 1 and, on an 80 GB card, XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (76 GiB). Start-up
compiles the 32-layer train step, prefill and decode loop once, for the trainer's memory check, and the first step
reuses them (measured before that change, which compiled the plan at depths 1 and 2 and then the 32-layer programs
again: ~3-4 minutes to the end of the first step).
Measured at full depth on one H200 (2026-12-06, random weights, docs/results/lora8b_grpo_step_h200.json; a smaller
batch than this config's, 4 prompts x 8 samples on 32 slots, 4096-token sequences, microbatch 1): GRPO step 59.0 s
vs BF16 LoRA 68.9 s (1.17x; rollout 44.1 vs 51.2 s, train 14.9 vs 17.7 s), token_mult_prob_error 1.0, peak 40.8 GiB
(plan 46.1). At 32 sequences a decode step costs ~12 ms (FP8) and ~14 ms (BF16), far above the time to read the
weights, so FP8's halved weight traffic shows little; this config's 128 slots is the shape to measure next.
"""

from configs import llama8b_fp8


def get_config(arg=None):
  c = llama8b_fp8.get_config(arg)
  c.workdir = "runs/llama8b_fp8_lora"
  c.lora.rank, c.lora.alpha = 64, 128.0  # all seven linears (c.lora.targets' default)
  c.optim.lr, c.optim.warmup_steps = 2e-5, 10
  c.optim.weight_decay = 0.0  # the adapters start at b = 0; decay would pull them back to the base
  c.mesh.fsdp = 1  # one GPU
  c.grpo.num_prompts, c.grpo.num_generations = 8, 16
  c.grpo.microbatch, c.grpo.mismatch_sample = 1, 16  # 2 needs 59.5 GiB of XLA temporaries (docstring)
  c.rollout.slots = 128
  return c
