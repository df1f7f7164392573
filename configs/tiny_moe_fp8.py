"""configs/tiny_fp8.py with Qwen3-MoE layers: the same task and GRPO loop, both layers mixture-of-experts.

Run: .venv/bin/python scripts/train.py --config=configs/tiny_moe_fp8.py
Model: 2 layers, each routing every token to 2 of 4 SwiGLU experts of width 256 (BF16 router, block-FP8 experts
through ops.grouped_linear: its reference on CPU, the grouped Hopper kernel on an H200), the attention of the tiny
default.
Result: 0.578 after the warm start -> 0.965 after GRPO (AMD EPYC, 2 cores, 2026-12-01), token_mult_prob_error 1.0
at every step.
"""

from configs import tiny_fp8


def get_config(arg=None):
  c = tiny_fp8.get_config(arg)
  c.workdir = "runs/tiny_moe_fp8"
  c.model.update(n_experts=4, n_experts_per_tok=2, moe_ffn_dim=256, norm_topk_prob=True)
  c.grpo.router_aux_coef = 0.0  # fp8jax.rl.trainer.GRPOConfig: the load-balancing loss stays off for RL
  return c
