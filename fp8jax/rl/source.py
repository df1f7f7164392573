"""What the GRPO loop needs from a task: the prompt-source interface, and the rules a source must follow.

The loop (``fp8jax.rl.trainer.RLTrainer``) and its rollout worker talk to their task only through these members.
Two sources implement them: the embedded arithmetic task (``ArithmeticSource`` below) and local math prompt files
(``fp8jax.rl.math_source.MathSource``); ``make_source`` picks one by the config's ``task``; ``tests/test_source.py``
checks both against the rules below. Your own task is an object with these members, passed as
``RLTrainer(config, workdir, source=it)`` (``check_source`` checks the members and token ids it can).

Rules (what makes a run resumable and its batches independent of who else asked for prompts):

1. ``train_prompts(n, step)`` is a pure function of ``(n, step)`` (and of the source's construction arguments):
   the same arguments give the same prompts, whatever was called before. ``step`` is a *prompt-batch index*, not
   necessarily the RL step: the loop draws batch 0, 1, 2, ... in order (dynamic sampling's refills draw further
   batches) and saves how many it has drawn in the checkpoint (``TrainState.prompt_batch``), so the data position
   lives in the checkpoint, not in the source. Calibration or any other extra call does not move it.
2. ``validation(n)`` returns the same first ``n`` held-out prompts every time; they never appear in training
   batches.
3. ``score(rollout, answers)`` is a pure function of the completions and answers: ``float32`` rewards, one per
   rollout row (row r answers ``answers[r]``).
4. ``state()`` returns a JSON-able dict describing what the prompts depend on (seed, dataset size, ...), saved in
   checkpoint metadata; ``load_state(meta)`` raises, naming what differs, when the checkpoint was written with
   another dataset or seed (resuming would silently train on other batches).

Prompts are token-id lists (the source tokenizes: chat template, BOS); answers are whatever ``score`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class PromptSource(Protocol):
  """The task interface of the GRPO loop (module docstring: rules 1-4)."""

  pad_id: int  # token id used to pad sequences
  eos_ids: tuple[int, ...]  # every token that ends a completion

  def train_prompts(self, n: int, step: int) -> tuple[list[list[int]], Sequence[Any]]:
    """Batch ``step`` of ``n`` training prompts (token ids) and their answers; pure in ``(n, step)``."""
    ...

  def validation(self, n: int) -> tuple[list[list[int]], Sequence[Any]]:
    """The first ``n`` held-out prompts and answers (the same every call)."""
    ...

  def score(self, ro, answers: Sequence[Any]) -> np.ndarray:
    """float32 rewards (R,) of a ``sampler.Rollout``'s rows against ``answers`` (one per row)."""
    ...

  def supervised_examples(self, n: int, step: int, seq_len: int):
    """Warm-start batch ``step`` (an ``fp8jax.rl.tasks.SupervisedBatch``), or a ValueError naming the config key
    when the source has none (then warmstart.steps must be 0)."""
    ...

  def state(self) -> dict:
    """JSON-able description of what the prompts depend on, for checkpoint metadata."""
    ...

  def load_state(self, meta: dict) -> None:
    """Checks a checkpoint's ``state()`` against this source; raises naming what differs."""
    ...


class ArithmeticSource:
  """The embedded arithmetic task (tokenized prompts, exact-match reward) as a ``PromptSource``.

  Batch ``step`` is ``ArithmeticTask.sample(n, step=step)``: a stream keyed by (seed, step), pure in ``step``.
  """

  def __init__(self, config):
    from fp8jax.rl import tasks  # noqa: PLC0415

    a = config.arithmetic
    self.task = tasks.ArithmeticTask(seed=int(config.seed), difficulty=a.difficulty, num_val=a.num_val)
    self.tok = self.task.tokenizer
    self.pad_id = self.tok.pad_id
    self.eos_id = self.tok.eos_id
    self.eos_ids = (self.tok.eos_id,)

  def _encode(self, prompts):
    return [self.tok.encode(p, add_bos=True) for p in prompts]

  def train_prompts(self, n, step):
    prompts, answers = self.task.sample(n, step=step)
    return self._encode(prompts), answers

  def validation(self, n):
    prompts, answers = self.task.validation()
    return self._encode(prompts[:n]), answers[:n]

  def supervised_examples(self, n, step, seq_len):
    return self.task.supervised_examples(n, step=step, seq_len=seq_len)

  def _decode(self, ids):
    # The model's vocabulary is padded to a multiple of 128; ids the tokenizer lacks decode as '?' (reward 0).
    v = self.tok.vocab_size
    return "".join(self.tok.decode([i]) if i < v else "?" for i in ids)

  def score(self, ro, answers):
    texts = [self._decode(ro.tokens[i, :ro.lengths[i]]) for i in range(len(answers))]
    return np.array([self.task.reward(t, a) for t, a in zip(texts, answers)], np.float32)

  def state(self):
    return {"task": self.task.state()}

  def load_state(self, meta):
    self.task.load_state(meta["task"])


def check_source(src, vocab_size: int) -> PromptSource:
  """``src`` if it has every member of ``PromptSource`` and token ids the model has; else a TypeError / ValueError
  naming what is missing or wrong (a user's own source, ``RLTrainer(..., source=src)``)."""
  members = ("pad_id", "eos_ids", "train_prompts", "validation", "score", "supervised_examples", "state", "load_state")
  missing = [m for m in members if not hasattr(src, m)]
  if missing:
    raise TypeError(f"source {type(src).__name__} lacks {missing} of the PromptSource interface "
                    f"(fp8jax/rl/source.py: {', '.join(members)})")
  ids = [src.pad_id, *src.eos_ids]
  if not src.eos_ids or any(not isinstance(i, (int, np.integer)) or not 0 <= i < vocab_size for i in ids):
    raise ValueError(f"source {type(src).__name__}: pad_id={src.pad_id!r} and eos_ids={tuple(src.eos_ids)!r} must be "
                     f"token ids in [0, model.vocab_size={vocab_size}), at least one eos id")
  return src


def make_source(config, vocab_size: int) -> PromptSource:
  """The config's ``task``: "arithmetic" (embedded) or "math" (prompt files, math-verify rewards)."""
  if config.task == "arithmetic":
    src = ArithmeticSource(config)
    if src.tok.vocab_size > vocab_size:
      raise ValueError(f"model.vocab_size={vocab_size} < the arithmetic tokenizer's {src.tok.vocab_size}")
  elif config.task == "math":
    from fp8jax.rl.math_source import MathSource  # noqa: PLC0415

    src = MathSource(config)
  else:
    raise ValueError(f"task={config.task!r} is not 'arithmetic' or 'math'")
  assert isinstance(src, PromptSource), type(src)
  return src
