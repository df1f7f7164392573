"""Math prompts from local files for the real recipes (e.g. OpenMathInstruct-2 with Llama-3.1-8B-Instruct).

Prompts come from ``fp8jax.rl.data`` (jsonl/parquet, configurable fields, template), are wrapped in the model's chat
template through the HF tokenizer (``fp8jax.hf.load_tokenizer``), and are scored by math-verify on the last
``\\boxed{}`` of the completion (``fp8jax.rl.rewards.math_reward``, binary, with a per-sample timeout).
"""

from __future__ import annotations

import os

import numpy as np

from fp8jax.rl import data, rewards


class MathSource:
  """The loop's data source for ``task = "math"`` (same interface as the embedded arithmetic task)."""

  def __init__(self, config):
    from fp8jax import hf  # noqa: PLC0415

    d = config.data
    tok_dir = d.tokenizer_dir or config.checkpoint.hf_dir
    if not d.path or not os.path.exists(d.path):
      raise FileNotFoundError(
          f"data.path={d.path!r} does not exist. Download the prompt set (e.g. nvidia/OpenMathInstruct-2, a jsonl or "
          f"parquet file with fields {data.OPENMATHINSTRUCT2_FIELDS}) and set --config.data.path=/path/to/file")
    if not tok_dir or not os.path.isdir(tok_dir):
      raise FileNotFoundError(
          f"checkpoint.hf_dir / data.tokenizer_dir={tok_dir!r} is not a directory. Download the model (e.g. "
          f"meta-llama/Llama-3.1-8B-Instruct: config.json, *.safetensors, tokenizer.json) and set "
          f"--config.checkpoint.hf_dir=/path/to/it")
    self.tok = hf.load_tokenizer(tok_dir)
    examples = data.load_prompts(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                 template=d.template, max_examples=d.max_examples or None)
    self.train, self.val = data.train_val_split(examples, d.val_size, seed=int(config.seed))
    self.iter = data.PromptIterator(self.train, int(config.grpo.num_prompts), seed=int(config.seed))
    self.pad_id = self.tok.pad_id if self.tok.pad_id is not None else self.tok.eos_ids[0]
    self.eos_id = self.tok.eos_ids[0]
    self.eos_ids = tuple(self.tok.eos_ids)
    self.timeout_s = float(getattr(d, "reward_timeout_s", 5.0))

  def _encode(self, prompts):
    return [list(self.tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True)) for p in prompts]

  def train_prompts(self, n, step):
    del step  # the iterator's position is the state (saved in checkpoints)
    batch = self.iter.next_batch()[:n]
    return self._encode([e.prompt for e in batch]), [e.answer for e in batch]

  def validation(self, n):
    val = self.val[:n]
    return self._encode([e.prompt for e in val]), [e.answer for e in val]

  def supervised_examples(self, n, step, seq_len):
    raise ValueError("warmstart.steps must be 0 for task='math' (start from a pretrained checkpoint instead)")

  def score(self, ro, answers):
    texts = [self.tok.decode(list(ro.tokens[i, :ro.lengths[i]])) for i in range(len(answers))]
    return np.asarray(rewards.score_batch(texts, list(answers), rewards.math_reward, timeout_s=self.timeout_s))

  def state(self):
    return {"data": self.iter.state()}

  def load_state(self, meta):
    self.iter = data.PromptIterator.from_state(self.train, meta["data"])
