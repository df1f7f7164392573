"""The BF16 baseline of configs/qwen3_8b_fp8_1gpu.py on one H200 (no quantization, BF16 KV cache, same steps), as
configs/llama8b_bf16_1gpu.py is Llama's: the FP32 master and the BF16 Adam moments in host memory between steps.

Run: python scripts/train.py --config=configs/qwen3_8b_bf16_1gpu.py --config.checkpoint.hf_dir=DIR --config.data.path=F
Memory per GPU, planned from shapes (`python scripts/plan_memory.py --config=configs/qwen3_8b_bf16_1gpu.py --devices=1
--device_gib=139 --notemporaries`, CPU, 2026-12-08): on the device the state is the BF16 KL reference, 15.3 GiB;
rollout phase 98.0 GiB (+ BF16 sampler weights 15.3, BF16 KV pool of 128 slots 67.5), train phase 45.8 GiB (+ FP32
gradient accumulator 30.5) before XLA's temporaries, which then also hold the step's device copies of the master and
the moments (61.0 GiB). Not yet run on a GPU.
"""

from configs import common, qwen3_8b_fp8_1gpu


def get_config(arg=None):
  c = common.to_bf16(qwen3_8b_fp8_1gpu.get_config(arg), "runs/qwen3_8b_bf16_1gpu")
  c.optim.offload = "pinned_host"  # the BF16 sampler weights, reference and KV pool need the room
  return c
