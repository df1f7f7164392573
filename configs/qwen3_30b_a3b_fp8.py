"""Qwen3-30B-A3B GRPO on OpenMathInstruct-2, FP8 end to end: configs/llama8b_fp8.py's recipe on the MoE model.

Run (after downloading Qwen/Qwen3-30B-A3B and the prompts):
  python scripts/train.py --config=configs/qwen3_30b_a3b_fp8.py \
      --config.checkpoint.hf_dir=/models/Qwen3-30B-A3B --config.data.path=/data/openmathinstruct2.jsonl
Hardware: 8x H200 (one host), parameters and optimizer state sharded over fsdp. Estimate, not measured: 30.5B
parameters need ~122 GB of FP32 master weights, ~244 GB of Adam moments, ~122 GB of FP32 gradients and ~31 GB each
for the FP8 sampler weights and the KL reference (grpo.kl_beta > 0), ~550 GB before activations and the KV cache;
4x H200 (564 GB) cannot hold that with room to run.
The experts' forward, dgrad and wgrad run grouped Hopper FP8 kernels (forward/dgrad bitwise the dense kernel per
expert on the H200; docs/performance.md "FP8 GEMM vs cuBLAS"). What is missing: the rows move
into the kernel's tile layout by XLA gathers, and the wgrad's operands are quantized by separate passes, so the whole
grouped ops run at 0.5-0.7x torch's BF16 grouped GEMM although the kernels reach 0.8-1.7x. Expert parallelism:
--config.mesh.expert=8 (with fsdp 1) puts 16 experts on each GPU (fp8jax/model/moe_parallel.py; checked on fake CPU
devices only, bitwise one device's rows). The full recipe has not been run. Measured (one H200, 2026-12-02;
docs/performance.md): 2 of 48 layers at the GRPO smoke shape (scripts/bench_grpo_step.py, random weights): 0.373 s per
step, the same as BF16 (launch-bound at 2,048 tokens), and sampler == trainer exactly (check_loop_exactness.py: 0 of
2048 tokens differ); at a training-like size (512 x 272 tokens per step, bench_grpo_step.py --set ..., 2026-12-03,
expert wgrads on the kernels) 2.86 s per step vs BF16 3.18 s (1.11x), still exact; per MoE layer (4 layers minus 2)
1.31x. Accuracy: nothing measured. The GRPO settings are llama8b_fp8.py's (NeMo RL's Llama-3.1-8B FP8 recipe), not
tuned for this model.
"""

import ml_collections

from configs import llama8b_fp8


def get_config(arg=None):
  c = llama8b_fp8.get_config(arg)
  c.workdir = "runs/qwen3_30b_a3b_fp8"
  # Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B on the Hub; used for random-weight smoke tests, with
  # checkpoint.hf_dir the architecture comes from the checkpoint): 48 layers, all mixture-of-experts (mlp_only_layers
  # empty, decoder_sparse_step 1; intermediate_size 6144 is then unused), 128 experts of width 768, top-8
  # renormalized, GQA 32/4 heads of 128 with QK-norm, untied embeddings. 30,532,122,624 parameters
  # (tests/test_hf_moe.py counts them with transformers).
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144,
      norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, tie_embeddings=False, qk_norm=True,
      n_experts=128, n_experts_per_tok=8, moe_ffn_dim=768, norm_topk_prob=True, decoder_sparse_step=1,
      mlp_only_layers=(), max_seq_len=4096, dtype="bfloat16", remat=True, attn_backend="auto"))
  c.grpo.router_aux_coef = 0.0  # fp8jax.rl.trainer.GRPOConfig: the load-balancing loss stays off for RL
  return c
