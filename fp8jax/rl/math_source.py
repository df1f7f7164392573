"""Math prompts from local files for the real recipes (e.g. OpenMathInstruct-2 with Llama-3.1-8B-Instruct).

Prompts come from ``fp8jax.rl.data`` (jsonl/parquet, configurable fields, template), are wrapped in the model's chat
template through the HF tokenizer (``fp8jax.hf.load_tokenizer``), and are scored by math-verify on the last
``\\boxed{}`` of the completion (``fp8jax.rl.rewards.math_reward``, binary, with a per-sample timeout), or by the
function ``data.reward`` names (``fp8jax.rl.rewards.resolve_reward``: your own reward on your own prompt file).
"""

from __future__ import annotations

import os

import numpy as np

from fp8jax.rl import data, rewards


class MathSource:
  """The loop's data source for ``task = "math"`` (the ``fp8jax.rl.source.PromptSource`` interface).

  Training batch ``k`` is ``data.prompt_batch(train split, grpo.num_prompts, k, seed)``: epoch-wise reshuffled,
  a pure function of ``k`` (the loop keeps the position, ``k``, in its checkpoints).
  """

  def __init__(self, config):
    from fp8jax import hf  # noqa: PLC0415

    d = config.data
    tok_dir = d.tokenizer_dir or config.checkpoint.hf_dir
    if not d.path or not os.path.exists(d.path):
      raise FileNotFoundError(
          f"data.path={d.path!r} does not exist. Download the prompt set (e.g. nvidia/OpenMathInstruct-2, a jsonl or "
          f"parquet file with fields {data.OPENMATHINSTRUCT2_FIELDS}) and set --config.data.path=/path/to/file, or "
          f"name a pinned data set and split, e.g. --config.data.path=gsm8k:train (scripts/get_data.py --list)")
    if not tok_dir or not os.path.isdir(tok_dir):
      raise FileNotFoundError(
          f"checkpoint.hf_dir / data.tokenizer_dir={tok_dir!r} is not a directory. Download the model (e.g. "
          f"meta-llama/Llama-3.1-8B-Instruct: config.json, *.safetensors, tokenizer.json) and set "
          f"--config.checkpoint.hf_dir=/path/to/it, or name a pinned model (scripts/get_model.py --list)")
    self.tok = hf.load_tokenizer(tok_dir)
    examples = data.load_prompts(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                 template=d.template, max_examples=d.max_examples or None)
    self.train, self.val = data.train_val_split(examples, d.val_size, seed=int(config.seed))
    self.seed = int(config.seed)
    self.batch_size = int(config.grpo.num_prompts)
    if len(self.train) < self.batch_size:
      raise ValueError(f"data.path={d.path!r}: {len(self.train)} training prompts (after data.val_size="
                       f"{d.val_size}) < grpo.num_prompts={self.batch_size}")
    self.pad_id = self.tok.pad_id if self.tok.pad_id is not None else self.tok.eos_ids[0]
    self.eos_id = self.tok.eos_ids[0]
    self.eos_ids = tuple(self.tok.eos_ids)
    self.timeout_s = float(getattr(d, "reward_timeout_s", 5.0))
    self.reward_spec = d.get("reward", "math")
    self.reward_fn = rewards.resolve_reward(self.reward_spec)

  def _encode(self, prompts):
    return [list(self.tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True)) for p in prompts]

  def train_prompts(self, n, step):
    if not 0 < n <= self.batch_size:
      raise ValueError(f"MathSource.train_prompts: n={n} must be in [1, grpo.num_prompts={self.batch_size}]")
    batch = data.prompt_batch(self.train, self.batch_size, step, seed=self.seed)[:n]
    return self._encode([e.prompt for e in batch]), [e.answer for e in batch]

  def validation(self, n):
    val = self.val[:n]
    return self._encode([e.prompt for e in val]), [e.answer for e in val]

  def supervised_examples(self, n, step, seq_len):
    raise ValueError("warmstart.steps must be 0 for task='math' (start from a pretrained checkpoint instead)")

  def score(self, ro, answers):
    # the completion's text without special tokens (its stop token), as scripts/eval_math.py scores it
    texts = [self.tok.decode(list(ro.tokens[i, :ro.lengths[i]]), skip_special_tokens=True)
             for i in range(len(answers))]
    try:
      return np.asarray(rewards.score_batch(texts, list(answers), self.reward_fn, timeout_s=self.timeout_s))
    except Exception as e:
      if self.reward_fn is rewards.math_reward:
        raise
      raise RuntimeError(f"data.reward={self.reward_spec!r} failed while scoring {len(texts)} completions: "
                         f"{type(e).__name__}: {e}") from e

  def state(self):
    return {"data": {"seed": self.seed, "batch_size": self.batch_size, "num_examples": len(self.train)}}

  def load_state(self, meta):
    """Refuses a checkpoint made with another split, batch size or seed (its batch k would be other prompts)."""
    saved, now = meta.get("data", {}), self.state()["data"]
    keys = {"seed": "seed", "batch_size": "grpo.num_prompts", "num_examples": "the training split's size"}
    diff = [f"{name}: {saved.get(k)} in the checkpoint, {now[k]} now" for k, name in keys.items()
            if saved.get(k) != now[k]]
    if diff:
      raise ValueError("the checkpoint's prompt data differ from this config's (" + "; ".join(diff) + "): "
                       "resuming would train on other batches. Use the checkpoint's data.path, data.val_size, "
                       "data.max_examples, seed and grpo.num_prompts, or start a new run in another --workdir")
