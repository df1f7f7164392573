"""Llama-3.1-8B-Instruct GRPO on OpenMathInstruct-2, FP8 end to end (mirrors NeMo RL's FP8 GRPO recipe).

Run (on Hopper GPUs, after downloading the model and the prompts):
  python scripts/train.py --config=configs/llama8b_fp8.py \
      --config.checkpoint.hf_dir=/models/Llama-3.1-8B-Instruct --config.data.path=/data/openmathinstruct2.jsonl
Hardware: 8x H100/H200 for the full recipe (64 prompts x 32 generations, 4096 tokens); the mesh shards params and
optimizer state over fsdp, and each GPU generates its share of the rollouts. Memory per GPU, planned from shapes
(`python scripts/plan_memory.py --config=configs/llama8b_fp8.py --devices=8 --device_gib=139`): 35.5 GiB before XLA's
temporaries; one GPU cannot hold it (the constructor refuses, naming mesh.fsdp). Without hf_dir / data.path the run stops at once and says what to download.
Expected: validation accuracy at the BF16 recipe's level (NeMo RL: 0.613 FP8 vs 0.616 BF16 on their setup); this
repository has not yet run the full recipe (see docs/performance.md for what was measured).
"""

import ml_collections

from configs import tiny_fp8

COT_TEMPLATE = ("Solve the following math problem step by step. Put your final answer inside \\boxed{}.\n\n"
                "{prompt}")


def get_config(arg=None):
  c = tiny_fp8.get_config(arg)
  c.task = "math"
  c.workdir = "runs/llama8b_fp8"
  # Architecture of Llama-3.1-8B (used for random-weight smoke tests; with checkpoint.hf_dir it comes from config.json).
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
      norm_eps=1e-5, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192), tie_embeddings=False, qk_norm=False,
      max_seq_len=4096, dtype="bfloat16", remat=True, attn_backend="auto"))
  c.fp8.kv_cache = "fp8"  # FP8 KV cache + scales recalibrated from the training forward each step
  c.data = ml_collections.ConfigDict(dict(
      path="", prompt_field="problem", answer_field="expected_answer", template=COT_TEMPLATE, val_size=256,
      max_examples=0, tokenizer_dir="", reward_timeout_s=5.0,
      reward="math"))  # "math" (math-verify on the last \boxed{}) or "package.module:function" (fp8jax/rl/rewards.py)
  c.rollout = ml_collections.ConfigDict(dict(
      slots=512, max_len=4096, max_new_tokens=3584, temperature=1.0, top_p=1.0, top_k=0, decode_chunk=32,
      kv_scale_margin=1.25, prompt_buckets=(128, 256, 512), max_refills_per_step=16, data_parallel=True,
      seed=0))
  c.grpo = ml_collections.ConfigDict(dict(
      num_prompts=64, num_generations=32, loss="grpo", normalize_std=True, leave_one_out=True, eps_low=0.2,
      eps_high=0.2, dual_clip=0.0, agg="token_mean", kl_beta=0.01, is_kind="none", is_lo=0.5, is_hi=2.0,
      recompute_old_logp=False, mismatch_sample=64, dynamic_sampling=False, max_refills=2, overlong_filter=False,
      minibatches=1, microbatch=8))
  c.optim = ml_collections.ConfigDict(dict(
      lr=5e-7, schedule="warmup_constant", warmup_steps=13, min_lr_ratio=0.1, weight_decay=0.01, b1=0.9, b2=0.999,
      eps=1e-8, grad_clip=1.0, state_dtype="float32", offload="none"))  # fp8jax/optim.py
  c.warmstart.steps = 0
  c.train = ml_collections.ConfigDict(dict(steps=500, val_every=10, val_prompts=256, collapse_steps=5,
                                           stop_on_collapse=True))
  c.checkpoint = ml_collections.ConfigDict(dict(every=10, keep=3, hf_dir="", resume=True))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, expert=1, tensor=1))
  return c
