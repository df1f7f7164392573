"""Greedy accuracy of an HF checkpoint on a math prompt file, through the rollout sampler (no trainer state).

The prompts are built as the GRPO loop builds them (``fp8jax.rl.math_source``: the data template, then the model's
chat template through ``fp8jax.hf.Tokenizer``), decoding stops at the model's EOS ids (tokenizer_config.json,
generation_config.json and config.json), and each completion is scored by ``fp8jax.rl.rewards.math_reward`` (the last
``\\boxed{}`` against the reference answer, math-verify). So a figure measured here is the validation accuracy the
loop would report at step 0 for the same prompts and recipe. ``scripts/eval_math.py`` is its command line.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from fp8jax import hf, ops, recipes
from fp8jax import sampler as sampler_lib
from fp8jax.rl import data, rewards


@dataclasses.dataclass(frozen=True)
class EvalResult:
  accuracy: float
  n: int
  boxed_frac: float  # completions with a closed \boxed{} (the format the reward needs)
  stopped_frac: float  # completions that ended at an EOS id within max_new_tokens
  mean_len: float
  seconds: float
  rows: list  # per problem: index, answer, reward, length, stopped, completion


def chat_prompt_ids(tok: hf.Tokenizer, text: str) -> list[int]:
  """One user message in the model's chat template, with the assistant turn opened (what the loop samples from)."""
  return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True))


def greedy_math(hf_dir: str, path: str, *, n: int, template: str = data.PLACEHOLDER, max_new_tokens: int = 256,
                recipe: recipes.Recipe = recipes.Recipe(mode="bf16"), slots: int = 32,
                prompt_buckets: tuple[int, ...] = (128, 256, 384, 512), timeout_s: float = 5.0,
                params=None, reward: str = "math") -> EvalResult:
  """Greedy accuracy on the first ``n`` records of ``path`` (module docstring). ``params``: master params already
  loaded from ``hf_dir`` (else loaded here). ``reward``: the score, as a config's ``data.reward`` names it ("math",
  or "package.module:function": ``fp8jax.rl.rewards.resolve_reward``); the accuracy is its mean."""
  reward_fn = rewards.resolve_reward(reward, "reward")
  tok = hf.load_tokenizer(hf_dir)
  if not tok.eos_ids:
    raise ValueError(f"{hf_dir}: no eos id in tokenizer_config.json, generation_config.json or config.json; "
                     f"generation could not stop")
  examples = data.load_prompts(path, template=template, max_examples=n)
  prompts = [chat_prompt_ids(tok, e.prompt) for e in examples]
  longest = max(len(p) for p in prompts)
  fits = [b for b in prompt_buckets if b >= longest]
  if not fits:
    raise ValueError(f"{path}: a prompt of the first {n} has {longest} tokens, more than the largest prompt bucket "
                     f"{max(prompt_buckets)}")
  max_len = fits[0] + max_new_tokens
  cfg = hf.load_config(hf_dir, max_seq_len=max_len)
  if params is None:
    params = hf.load_params(hf_dir, cfg)
  lcfg = ops.LinearConfig.from_recipe(recipe)
  s = sampler_lib.Sampler(cfg, sampler_lib.SamplerConfig(slots=slots, max_len=max_len, prompt_buckets=prompt_buckets,
                                                         kv_cache=recipe.kv_cache), lcfg)
  sparams = s.sampling_form(sampler_lib.prepare_params(params, recipe))
  kv = s.calibrate_kv_scales(sparams, prompts, 1.25) if recipe.kv_cache == "fp8" else None
  sp = sampler_lib.SamplingParams(greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=tuple(tok.eos_ids))
  t0 = time.perf_counter()
  ro = s.generate(sparams, prompts, sp, n=1, kv_scales=kv)
  seconds = time.perf_counter() - t0
  texts = [tok.decode(list(ro.tokens[i, :ro.lengths[i]]), skip_special_tokens=True) for i in range(len(prompts))]
  answers = [e.answer for e in examples]
  scores = rewards.score_batch(texts, answers, reward_fn, timeout_s=timeout_s)
  stopped = ro.finish_reason == sampler_lib.FINISH_STOP
  rows = [{"index": e.index, "answer": a, "reward": float(r), "length": int(ln), "stopped": bool(st),
           "completion": t} for e, a, r, ln, st, t in zip(examples, answers, scores, ro.lengths, stopped, texts)]
  return EvalResult(accuracy=float(np.mean(scores)), n=len(prompts),
                    boxed_frac=float(np.mean([rewards.extract_last_boxed(t) is not None for t in texts])),
                    stopped_frac=float(np.mean(stopped)), mean_len=float(np.mean(ro.lengths)), seconds=seconds,
                    rows=rows)
