"""Prompt datasets from local files, a deterministic train/validation split, and a resumable prompt iterator.

Files: ``.jsonl`` (one JSON object per line) or ``.parquet`` (needs ``pyarrow``; not a dependency of fp8jax --
install it, or convert to jsonl). Nothing is downloaded: the config points at files on disk.

Fields are configurable and may be dotted paths into nested records. Two datasets the recipes use:

* **OpenMathInstruct-2** (``nvidia/OpenMathInstruct-2``; columns ``problem``, ``generated_solution``,
  ``expected_answer``, ``problem_source``): ``prompt_field="problem"``, ``answer_field="expected_answer"``.
  The answer is a bare LaTeX/number string (``"\\frac{1}{2}"``, ``"34"``); the template must ask for
  ``\\boxed{}`` because ``rewards.math_reward`` grades the last box.
* **DAPO-Math-17k** (``BytedTsinghua-SIA/DAPO-Math-17k``, verl's RL parquet format; columns ``data_source``,
  ``prompt``, ``ability``, ``reward_model``, ``extra_info``): ``prompt_field="prompt"``,
  ``answer_field="reward_model.ground_truth"``. Its ``prompt`` is a chat list ``[{"role": "user", "content":
  ...}]``; a chat list is reduced to the content of its last user message. In the original release that content
  already wraps the problem in DAPO's own instruction (as we recall it, a final ``Answer: ...`` line rather than a
  ``\\boxed{}``; not re-checked here -- look at one row of your copy): the template and the reward must agree
  with whatever instruction the prompt carries. ``ground_truth`` answers are integers stored as strings.

Templates: ``template`` must contain ``{prompt}``, which is replaced by the prompt text. It is a plain string
replacement, not ``str.format``, so LaTeX braces like ``\\boxed{}`` in the instruction need no escaping.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

PLACEHOLDER = "{prompt}"

# Field presets for the datasets named in the module docstring.
OPENMATHINSTRUCT2_FIELDS = {"prompt_field": "problem", "answer_field": "expected_answer"}
DAPO_MATH_17K_FIELDS = {"prompt_field": "prompt", "answer_field": "reward_model.ground_truth"}


@dataclasses.dataclass(frozen=True)
class PromptExample:
  """One prompt: ``prompt`` is the templated text the sampler sees; ``answer`` the ground truth; ``index`` the row
  of the source file (stable across shuffles, for logging)."""

  prompt: str
  answer: str
  index: int


# ------------------------------------------------------------------------------------------------------------------
# Reading files
# ------------------------------------------------------------------------------------------------------------------


def read_records(path: str) -> list[dict[str, Any]]:
  """All records of a ``.jsonl`` or ``.parquet`` file, as dicts."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"dataset file not found: {path}")
  lower = path.lower()
  if lower.endswith(".jsonl") or lower.endswith(".jsonl.txt"):
    records = []
    with open(path, encoding="utf-8") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          rec = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
          raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(rec).__name__}")
        records.append(rec)
    return records
  if lower.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise ImportError(f"reading {path} needs pyarrow, which is not installed; `pip install pyarrow` or convert "
                        "the file to .jsonl") from None
    return pq.read_table(path).to_pylist()
  raise ValueError(f"unsupported dataset file type: {path} (expected .jsonl or .parquet)")


_MISSING = object()


def get_field(record: dict[str, Any], field: str) -> Any:
  """``record[a][b]...`` for ``field = "a.b..."``; a key containing dots literally is tried first."""
  if field in record:
    return record[field]
  cur: Any = record
  for part in field.split("."):
    if isinstance(cur, dict) and part in cur:
      cur = cur[part]
    else:
      return _MISSING
  return cur


def _prompt_text(value: Any, where: str) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
    user = [m for m in value if m.get("role") == "user"]
    if not user or not isinstance(user[-1].get("content"), str):
      raise ValueError(f"{where}: chat-format prompt has no user message with string content")
    return user[-1]["content"]
  raise ValueError(f"{where}: prompt must be a string or a chat list of {{role, content}} messages, "
                   f"got {type(value).__name__}")


def _answer_text(value: Any, where: str) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, bool) or value is None:
    raise ValueError(f"{where}: answer must be a string or a number, got {value!r}")
  if isinstance(value, (int, float)):
    return str(value)
  if isinstance(value, (list, tuple)) and len(value) == 1:
    return _answer_text(value[0], where)
  raise ValueError(f"{where}: answer must be a string or a number, got {type(value).__name__}")


def apply_template(template: str, prompt: str) -> str:
  if PLACEHOLDER not in template:
    raise ValueError(f"prompt template must contain {PLACEHOLDER!r}: {template!r}")
  return template.replace(PLACEHOLDER, prompt)


def load_prompts(path: str, *, prompt_field: str = "problem", answer_field: str = "expected_answer",
                 template: str = PLACEHOLDER, max_examples: int | None = None) -> list[PromptExample]:
  """Read ``path`` and build templated ``PromptExample``s (file order; ``max_examples`` keeps the first rows).

  A record without the prompt or answer field is an error naming the file, the row and the field (a silent skip
  would quietly shrink the dataset when a field name is mistyped).
  """
  if PLACEHOLDER not in template:
    raise ValueError(f"prompt template must contain {PLACEHOLDER!r}: {template!r}")
  records = read_records(path)
  if max_examples is not None:
    records = records[:max_examples]
  if not records:
    raise ValueError(f"{path}: no records")
  out = []
  for i, rec in enumerate(records):
    where = f"{path} row {i}"
    for field in (prompt_field, answer_field):
      if get_field(rec, field) is _MISSING:
        raise KeyError(f"{where}: missing field {field!r} (available top-level fields: {sorted(rec)})")
    prompt = _prompt_text(get_field(rec, prompt_field), f"{where} field {prompt_field!r}")
    answer = _answer_text(get_field(rec, answer_field), f"{where} field {answer_field!r}")
    out.append(PromptExample(apply_template(template, prompt), answer.strip(), i))
  return out


# ------------------------------------------------------------------------------------------------------------------
# Split and iteration
# ------------------------------------------------------------------------------------------------------------------


def train_val_split(examples: Sequence[PromptExample], val_size: int | float, *, seed: int = 0
                    ) -> tuple[list[PromptExample], list[PromptExample]]:
  """Deterministic held-out split: a seeded permutation, the first ``val_size`` go to validation.

  ``val_size`` is a count (int) or a fraction in (0, 1) (float). The same file, ``val_size`` and ``seed`` always
  give the same split; both parts keep file order (so validation metrics are comparable across runs).
  """
  n = len(examples)
  if isinstance(val_size, float):
    if not 0.0 < val_size < 1.0:
      raise ValueError(f"train_val_split: fractional val_size must be in (0, 1), got {val_size}")
    k = max(1, int(round(val_size * n)))
  else:
    k = int(val_size)
  if not 0 <= k < n:
    raise ValueError(f"train_val_split: val_size={val_size} leaves no training data ({n} examples)")
  perm = np.random.default_rng([seed, 0x5EED]).permutation(n)
  val_idx = np.sort(perm[:k])
  train_idx = np.sort(perm[k:])
  return [examples[i] for i in train_idx], [examples[i] for i in val_idx]


def prompt_batch(examples: Sequence[PromptExample], batch_size: int, index: int, *, seed: int = 0
                 ) -> list[PromptExample]:
  """Batch ``index`` of the epoch-wise shuffled stream, as a pure function (``PromptIterator``'s k-th batch).

  Epoch ``e = index // batches_per_epoch`` visits the examples in the order ``permutation(seed, e)``; the batch is
  the ``index % batches_per_epoch``-th run of ``batch_size`` of them (an epoch's last ``n % batch_size`` are
  skipped, differently each epoch). The same arguments always give the same batch, whatever was drawn before.
  """
  n = len(examples)
  if batch_size < 1 or n < batch_size:
    raise ValueError(f"prompt_batch: need 1 <= batch_size <= {n} examples, got batch_size={batch_size}")
  if index < 0:
    raise ValueError(f"prompt_batch: index must be >= 0, got {index}")
  epoch, i = divmod(int(index), n // batch_size)
  order = np.random.default_rng([seed, epoch]).permutation(n)
  return [examples[j] for j in order[i * batch_size:(i + 1) * batch_size]]


class PromptIterator:
  """Batches of prompts: a fresh seeded permutation each epoch, and a position that checkpoints can save.

  Epoch ``e`` visits the examples in the order ``permutation(seed, e)``; ``batch_size`` consecutive examples form
  a batch. The last ``n % batch_size`` examples of an epoch are skipped (every batch has the static size the jitted
  sampler wants); each epoch skips different ones because the permutation changes. ``state()`` is a small dict of
  plain ints; ``PromptIterator.from_state(examples, state)`` continues exactly where the saved iterator stopped.
  """

  def __init__(self, examples: Sequence[PromptExample], batch_size: int, *, seed: int = 0, epoch: int = 0,
               index: int = 0):
    n = len(examples)
    if batch_size < 1:
      raise ValueError(f"PromptIterator: batch_size must be >= 1, got {batch_size}")
    if n < batch_size:
      raise ValueError(f"PromptIterator: {n} examples < batch_size={batch_size}")
    self.examples = list(examples)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.epoch = int(epoch)
    self.index = int(index)
    if not (0 <= self.index <= n - n % self.batch_size) or self.index % self.batch_size:
      raise ValueError(f"PromptIterator: index={index} is not a batch boundary of an epoch of {n} examples")
    self._perm_epoch = -1
    self._perm = None

  @property
  def batches_per_epoch(self) -> int:
    return len(self.examples) // self.batch_size

  def _order(self) -> np.ndarray:
    if self._perm_epoch != self.epoch:
      self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))
      self._perm_epoch = self.epoch
    return self._perm

  def next_batch(self) -> list[PromptExample]:
    if self.index + self.batch_size > len(self.examples):
      self.epoch += 1
      self.index = 0
    idx = self._order()[self.index:self.index + self.batch_size]
    self.index += self.batch_size
    return [self.examples[i] for i in idx]

  def __iter__(self) -> Iterator[list[PromptExample]]:
    return self

  def __next__(self) -> list[PromptExample]:
    return self.next_batch()

  def state(self) -> dict[str, int]:
    return {"seed": self.seed, "epoch": self.epoch, "index": self.index, "batch_size": self.batch_size,
            "num_examples": len(self.examples)}

  @classmethod
  def from_state(cls, examples: Sequence[PromptExample], state: dict[str, int]) -> "PromptIterator":
    for key in ("seed", "epoch", "index", "batch_size", "num_examples"):
      if key not in state:
        raise KeyError(f"PromptIterator.from_state: missing key {key!r} (got {sorted(state)})")
    if state["num_examples"] != len(examples):
      raise ValueError(f"PromptIterator.from_state: the state was saved for {state['num_examples']} examples but "
                       f"{len(examples)} were given (different file, split or max_examples?)")
    return cls(examples, state["batch_size"], seed=state["seed"], epoch=state["epoch"], index=state["index"])
