"""configs/llama8b_fp8_1gpu.py on Qwen3-8B: full-parameter GRPO on one H200, FP8 end to end, full depth (36 layers),
4096-token sequences, Adam moments stored in BF16 (the FP32 master kept), 32 prompts x 16 samples, microbatch 4,
128 decode slots; Qwen3-8B's architecture as in configs/qwen3_8b_fp8_lora.py (hidden 4096, 32 query / 8 KV heads of
128 with QK-norm, FFN 12288, vocabulary 151936, untied head, rope_theta 1e6).

Run (one H200, after downloading the model and the prompts):
  python scripts/train.py --config=configs/qwen3_8b_fp8_1gpu.py \\
      --config.checkpoint.hf_dir=/models/Qwen3-8B --config.data.path=/data/prompts.jsonl
Memory per GPU, planned from shapes (`python scripts/plan_memory.py --config=configs/qwen3_8b_fp8_1gpu.py --devices=1
--device_gib=139 --notemporaries`, CPU, 2026-12-08): state 69.8 GiB (FP32 master 30.5, BF16 Adam moments 30.5, FP8
KL reference 8.8), rollout phase 112.4 GiB (+ sampler weights 8.8, FP8 KV pool 33.8), train phase 100.3 GiB (+ FP32
gradient accumulator 30.5): fits 139 GiB before XLA's temporaries, with less room for them than the Llama twin
(26.6 GiB in the rollout phase, 38.7 in the train phase; its 36 layers and the larger vocabulary). The trainer compiles
the train step, prefill and decode loop for the GPU when it starts and refuses the run, naming the keys, if their
temporaries do not fit; then lower grpo.microbatch, rollout.slots, or set optim.offload='pinned_host' (master and
moments in host memory between steps: -61.0 GiB of state).
Measured: not yet run on a GPU.
"""

from configs import llama8b_fp8_1gpu, qwen3_8b_fp8_lora


def get_config(arg=None):
  c = llama8b_fp8_1gpu.get_config(arg)
  c.workdir = "runs/qwen3_8b_fp8_1gpu"
  c.model = qwen3_8b_fp8_lora.get_config(arg).model  # the architecture, one definition (random-weight runs)
  return c
