"""configs/llama8b_fp8.py on one H200: full-parameter GRPO of Llama-3.1-8B, FP8 end to end, full depth (32 layers),
4096-token sequences (512-token prompts + 3584 new tokens), Adam moments stored in BF16 (fp8jax/optim.py; the FP32
master is kept), a smaller step (32 prompts x 16 samples) and microbatch.

Run (one H200, after downloading the model and the prompts):
  python scripts/train.py --config=configs/llama8b_fp8_1gpu.py \\
      --config.checkpoint.hf_dir=/models/Llama-3.1-8B-Instruct --config.data.path=/data/openmathinstruct2.jsonl
Memory per GPU, planned from shapes (`python scripts/plan_memory.py --config=configs/llama8b_fp8_1gpu.py --devices=1
--device_gib=139 --notemporaries`, CPU, 2026-12-06): state 68.3 GiB (FP32 master 29.9, BF16 Adam moments 29.9,
FP8 KL reference 8.5), rollout phase 106.7 GiB (+ sampler weights 8.5, FP8 KV pool 30.0), train phase 98.2 GiB
(+ FP32 gradient accumulator 29.9): fits 139 GiB before XLA's temporaries, which leave 32-41 GiB for them. The
temporaries of the train step, prefill and decode loop are compiled for the GPU when the trainer starts (the
constructor refuses the run, naming the keys, if they do not fit); XLA:CPU's are no guide to the GPU's. Not yet
measured on a GPU: `python scripts/plan_memory.py --config=configs/llama8b_fp8_1gpu.py --measure_steps=1
--config.task=arithmetic` puts the plan beside the allocator. If the train phase does not fit, lower grpo.microbatch
first, then set optim.offload='pinned_host' (master + moments in host memory between steps: -59.8 GiB of state).
Expected: as configs/llama8b_fp8.py, at 1/8 of its throughput; not yet run.
"""

from configs import llama8b_fp8


def get_config(arg=None):
  c = llama8b_fp8.get_config(arg)
  c.workdir = "runs/llama8b_fp8_1gpu"
  c.mesh.fsdp = 1  # one device: no sharding
  c.optim.state_dtype = "bfloat16"  # Adam moments 2 + 2 bytes per parameter (FP32: 4 + 4)
  c.optim.offload = "none"  # "pinned_host" if the GPU's compiled temporaries leave too little (see docstring)
  c.grpo.num_prompts, c.grpo.num_generations = 32, 16  # 512 rollouts per step (the 8-GPU recipe: 64 x 32)
  c.grpo.microbatch = 4  # 4 x 4096 tokens per gradient microbatch (the head's logits dominate the temporaries)
  c.rollout.slots = 128  # decode rows: the FP8 KV pool of 128 slots x 3584 new tokens (256: 59 GiB, too tight)
  return c
