"""The BF16 baseline of configs/llama8b_fp8_1gpu.py on one H200 (no quantization, BF16 KV cache, same steps).

Run: python scripts/train.py --config=configs/llama8b_bf16_1gpu.py --config.checkpoint.hf_dir=... --config.data.path=...
Memory per GPU, planned from shapes (`python scripts/plan_memory.py --config=configs/llama8b_bf16_1gpu.py --devices=1
--device_gib=139 --notemporaries`, CPU, 2026-12-06): BF16 weights and KV cache take twice the FP8 recipe's bytes,
so this config keeps the FP32 master (29.9 GiB) and the BF16 Adam moments (29.9 GiB) in host memory between steps
(optim.offload='pinned_host'): on the device the state is the BF16 KL reference, 15.0 GiB; rollout phase 89.9 GiB
(+ BF16 sampler weights 15.0, BF16 KV pool of 128 slots 60.0), train phase 44.9 GiB (+ FP32 gradient accumulator
29.9) before XLA's temporaries, which then also hold the step's device copies of the master and the moments
(59.8 GiB). Not yet measured on a GPU
(`python scripts/plan_memory.py --config=configs/llama8b_bf16_1gpu.py --measure_steps=1 --config.task=arithmetic`).
"""

from configs import common, llama8b_fp8_1gpu


def get_config(arg=None):
  c = common.to_bf16(llama8b_fp8_1gpu.get_config(arg), "runs/llama8b_bf16_1gpu")
  c.optim.offload = "pinned_host"  # the BF16 sampler weights, reference and KV pool need the room
  c.rollout.slots = 128  # the BF16 KV pool: 2 bytes per element
  return c
