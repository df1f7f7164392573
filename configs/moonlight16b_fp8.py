"""Moonlight-16B-A3B GRPO on OpenMathInstruct-2, FP8 end to end (mirrors NeMo RL's Moonlight FP8 GRPO recipe).

Run (after downloading moonshotai/Moonlight-16B-A3B-Instruct and the prompts):
  python scripts/train.py --config=configs/moonlight16b_fp8.py \
      --config.checkpoint.hf_dir=/models/Moonlight-16B-A3B-Instruct --config.data.path=/data/openmathinstruct2.jsonl
Hardware: 8x H200 (one host), parameters and optimizer state sharded over fsdp. Estimate, not measured: 15.96B
parameters need ~64 GB of FP32 master weights, ~128 GB of Adam moments, ~64 GB of FP32 gradients and ~16-32 GB each
for the sampler weights and the KL reference, ~300 GB before activations and the latent KV cache.
NeMo RL's recipe (issue 19): 32 prompts x 16 generations, lr 1e-6, KL 0.04, the MLA projections kept in BF16 (here
by fp8.keep_patterns: q_proj / q_a / q_b and kv_a; kv_b is never FP8 in fp8jax, fp8jax/model/schema.py says why),
o_proj, the dense MLP and the experts block FP8; the router BF16 with FP32 logits. The remaining GRPO settings are
configs/llama8b_fp8.py's (NeMo RL's Llama-3.1-8B FP8 recipe), not checked against NeMo's Moonlight file.
The experts' forward, dgrad and wgrad run the grouped Hopper kernels. What is missing: MLA's absorbed attention has
head dim 576, which the Pallas attention kernels do not take, so attention falls back to the reference (logged), which
keeps every key block's scores for the backward: not fit for 4096-token training on a GPU, and not batch invariant
there (sampler vs trainer token_mult_prob_error 1.0016 on the H200 with the FP8 latent cache). Expert parallelism
(NeMo's recipe uses it): --config.mesh.expert=8 puts 8 routed experts on each GPU (fp8jax/model/moe_parallel.py; fake
CPU devices only so far). The full recipe has not been run. Measured (one H200, 2026-12-02; docs/performance.md):
2 of 27 layers at the GRPO smoke shape 0.302 s per step (BF16 0.300); at a training-like size (512 x 272 tokens per
step, 2026-12-03, expert wgrads on the kernels) 3.28 s vs BF16 3.57 s (1.09x), token_mult_prob_error 1.0; 8 layers,
128 slots, 256 -> 512 tokens: 6,551 decode tok/s with the FP8 latent cache.
"""

import ml_collections

from configs import llama8b_fp8


def get_config(arg=None):
  c = llama8b_fp8.get_config(arg)
  c.workdir = "runs/moonlight16b_fp8"
  # Moonlight-16B-A3B's config.json (DeepseekV3ForCausalLM; with checkpoint.hf_dir the architecture comes from the
  # checkpoint): 27 layers, layer 0 dense (first_k_dense_replace 1, intermediate_size 11264), then 64 routed experts
  # of width 1408, top-6 (noaux_tc with n_group = topk_group = 1), 2 shared experts, routed_scaling_factor 2.446; MLA
  # with 16 heads, no q LoRA, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, rope_theta 50000 without scaling.
  # 15,960,110,208 parameters (tests/test_mla.py counts them with transformers).
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=163840, dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, head_dim=192, ffn_dim=11264,
      norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None, rope_yarn=None, tie_embeddings=False, qk_norm=False,
      kv_lora_rank=512, q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
      rope_interleave=True, n_experts=64, n_experts_per_tok=6, moe_ffn_dim=1408, norm_topk_prob=True,
      moe_router="sigmoid", n_group=1, topk_group=1, routed_scaling_factor=2.446, n_shared_experts=2,
      mlp_only_layers=(0,), decoder_sparse_step=1, max_seq_len=4096, dtype="bfloat16", remat=True,
      attn_backend="auto"))
  c.fp8.keep_patterns = ("*/wq", "*/wq_a", "*/wq_b", "*/wkv_a")  # NeMo RL keeps MLA's projections BF16
  c.grpo.num_prompts = 32
  c.grpo.num_generations = 16
  c.grpo.kl_beta = 0.04
  c.grpo.router_aux_coef = 0.0  # the load-balancing loss stays off for RL (DeepSeek-V3 routing is aux-loss-free)
  c.optim.lr = 1e-6
  return c
