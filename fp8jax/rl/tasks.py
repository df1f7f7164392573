"""The embedded task of the tiny default configs: procedurally generated arithmetic, character-level, no downloads.

A prompt is an expression ending in ``=`` (``"37+48="``); the completion is the integer result followed by EOS
(``"85"``). Answers are a few digits, so a 1-5M parameter transformer can learn the format and part of the task
from a short supervised warm-start, and RL then has a dense, exactly verifiable reward to climb (see
``fp8jax.rl.rewards.arithmetic_reward``). Difficulty is a parameter (``DIFFICULTY`` below, or your own
``ArithmeticSpec``): more operands, larger numbers, subtraction and multiplication make it harder.

Determinism: everything is a function of ``seed``. Training batches are drawn from a stream keyed by
``(seed, kind, step)``, so batch ``k`` is the same whether or not the run was interrupted (``sample(n, step=k)``);
the validation problems are drawn from their own stream and never appear in training batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fp8jax.rl import rewards

# ------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------------------

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
DEFAULT_CHARS = " 0123456789+-*/=()"


class CharTokenizer:
  """One token per character, plus ``pad = 0``, ``bos = 1``, ``eos = 2``.

  The vocabulary is ``[pad, bos, eos] + list(chars)`` (at most 128 entries: the model pads its vocabulary to a
  multiple of 128, so this stays one tile). ``encode`` never adds specials by itself -- the caller decides where a
  sequence starts and ends -- and raises on a character outside the vocabulary, naming it.
  """

  def __init__(self, chars: str = DEFAULT_CHARS):
    if len(set(chars)) != len(chars):
      dup = sorted({c for c in chars if chars.count(c) > 1})
      raise ValueError(f"CharTokenizer: duplicate characters {dup!r}")
    self.chars = chars
    self.itos = [PAD, BOS, EOS] + list(chars)
    if len(self.itos) > 128:
      raise ValueError(f"CharTokenizer: vocab size {len(self.itos)} > 128")
    self.stoi = {c: i + 3 for i, c in enumerate(chars)}

  pad_id = 0
  bos_id = 1
  eos_id = 2

  @property
  def vocab_size(self) -> int:
    return len(self.itos)

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ids = []
    for pos, c in enumerate(text):
      i = self.stoi.get(c)
      if i is None:
        raise ValueError(f"CharTokenizer.encode: character {c!r} at position {pos} of {text!r} is not in the "
                         f"vocabulary {self.chars!r}")
      ids.append(i)
    return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

  def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
    """Text of ``ids``: pad and bos are skipped; decoding stops at the first eos (or skips eos if not stopping)."""
    out = []
    for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
      if i == self.eos_id:
        if stop_at_eos:
          break
        continue
      if i in (self.pad_id, self.bos_id):
        continue
      if not 0 <= i < len(self.itos):
        raise ValueError(f"CharTokenizer.decode: token id {i} is outside the vocabulary (size {self.vocab_size})")
      out.append(self.itos[i])
    return "".join(out)


# ------------------------------------------------------------------------------------------------------------------
# Problems
# ------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
  """What problems look like: ``k`` operands (``min_operands <= k <= max_operands``), each uniform in
  ``[0, max_operand]``, joined by operators drawn uniformly from ``ops`` (a subset of ``"+-*"``), evaluated with the
  usual precedence (``*`` before ``+``/``-``). With ``allow_negative=False`` problems whose result is negative are
  redrawn, so answers are plain digit strings. With ``reverse_answer=True`` the answer is written least-significant
  digit first ("37+48=" -> "58"): each output digit then depends only on aligned input digits and the carry just
  written, which small transformers learn far faster (Lee et al. 2023, "Teaching Arithmetic to Small
  Transformers", sec. 4); the reward then compares the digit strings exactly. With ``pad_operands=True`` every
  operand is written zero-padded to the width of ``max_operand`` ("07+48="), so the digits an output digit depends
  on sit at the same offsets in every problem; the answer keeps its plain digits."""

  min_operands: int = 2
  max_operands: int = 2
  max_operand: int = 99
  ops: str = "+"
  allow_negative: bool = False
  reverse_answer: bool = False
  pad_operands: bool = False

  def __post_init__(self):
    if not 2 <= self.min_operands <= self.max_operands:
      raise ValueError(f"ArithmeticSpec: need 2 <= min_operands <= max_operands, got {self.min_operands}, "
                       f"{self.max_operands}")
    if self.max_operand < 1:
      raise ValueError(f"ArithmeticSpec: max_operand must be >= 1, got {self.max_operand}")
    if not self.ops or set(self.ops) - set("+-*") or len(set(self.ops)) != len(self.ops):
      raise ValueError(f"ArithmeticSpec: ops must be distinct characters from '+-*', got {self.ops!r}")

  @property
  def max_result(self) -> int:
    """An upper bound on |result| (for sizing the answer length)."""
    m, k = self.max_operand, self.max_operands
    return m**k if "*" in self.ops else m * k

  @property
  def num_problems_upper_bound(self) -> int:
    """Distinct expressions (before rejecting negative results)."""
    v, o = self.max_operand + 1, len(self.ops)
    return sum(v**k * o ** (k - 1) for k in range(self.min_operands, self.max_operands + 1))


# Named levels. 6 is the tiny default's (configs/tiny_fp8.py): two 2-digit addends, answers up to 198, 10^4 problems.
DIFFICULTY: dict[int, ArithmeticSpec] = {
    0: ArithmeticSpec(2, 2, 9, "+"),         # a+b, one digit each: 100 problems, answers 0..18
    1: ArithmeticSpec(2, 2, 99, "+"),        # a+b, up to two digits
    2: ArithmeticSpec(2, 3, 99, "+"),        # two or three addends
    3: ArithmeticSpec(2, 3, 99, "+-"),       # with subtraction (non-negative results)
    4: ArithmeticSpec(2, 3, 20, "+-*"),      # with multiplication and precedence
    5: ArithmeticSpec(2, 2, 99, "+", reverse_answer=True),  # level 1, answer least-significant digit first
    6: ArithmeticSpec(2, 2, 99, "+", reverse_answer=True, pad_operands=True),  # level 5, operands zero-padded
}


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
  """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter than ``+``/``-`` (no eval())."""
  if len(ops) != len(operands) - 1:
    raise ValueError(f"evaluate: {len(operands)} operands need {len(operands) - 1} operators, got {len(ops)}")
  total, term, sign = 0, operands[0], 1
  for op, x in zip(ops, operands[1:]):
    if op == "*":
      term *= x
    else:
      total += sign * term
      sign, term = (1 if op == "+" else -1), x
  return total + sign * term


@dataclasses.dataclass(frozen=True)
class SupervisedBatch:
  """Padded next-token training data for the warm-start.

  ``tokens_NxL``: ``[bos] + prompt + answer + [eos]`` then pad (int32). ``loss_mask_NxL`` (float32) is 1 at the
  positions of answer and eos tokens, i.e. the tokens the model must *predict*: with inputs ``tokens[:, :-1]`` and
  targets ``tokens[:, 1:]`` use ``loss_mask[:, 1:]``. ``prompt_len_N`` counts bos + prompt.
  """

  tokens_NxL: np.ndarray
  loss_mask_NxL: np.ndarray
  prompt_len_N: np.ndarray


_STREAM_TRAIN, _STREAM_SUPERVISED, _STREAM_VAL = 1, 2, 3


class ArithmeticTask:
  """Arithmetic problems with a held-out validation set, deterministic from ``seed``.

  ``difficulty`` is a key of ``DIFFICULTY`` or an ``ArithmeticSpec``. ``num_val`` validation problems (default:
  256, capped at a quarter of the problem space) are drawn once and excluded from every training draw, so
  validation accuracy measures generalization rather than memorization.
  """

  def __init__(self, seed: int = 0, difficulty: int | ArithmeticSpec = 1, *, num_val: int | None = None,
               tokenizer: CharTokenizer | None = None):
    if isinstance(difficulty, ArithmeticSpec):
      self.spec = difficulty
    elif difficulty in DIFFICULTY:
      self.spec = DIFFICULTY[difficulty]
    else:
      raise ValueError(f"ArithmeticTask: difficulty={difficulty!r} is not one of {sorted(DIFFICULTY)} "
                       "or an ArithmeticSpec")
    self.seed = int(seed)
    self.tokenizer = tokenizer or CharTokenizer()
    space = self.spec.num_problems_upper_bound
    if num_val is None:
      num_val = min(256, space // 4)
    if not 0 <= num_val <= space // 2:
      raise ValueError(f"ArithmeticTask: num_val={num_val} must be in [0, {space // 2}] (half of the at most "
                       f"{space} distinct problems of this difficulty), so training keeps enough problems")
    self._next_step = {_STREAM_TRAIN: 0, _STREAM_SUPERVISED: 0}
    self.val_prompts, self.val_answers = self._draw_validation(num_val)
    self._val_set = frozenset(self.val_prompts)
    # Static lengths for jit: bos + longest expression; longest answer + eos.
    digits = len(str(self.spec.max_operand))
    self.max_prompt_len = 1 + self.spec.max_operands * digits + (self.spec.max_operands - 1) + 1
    self.max_answer_len = len(str(self.spec.max_result)) + (0 if not self.spec.allow_negative else 1) + 1

  # -- drawing -------------------------------------------------------------------------------------------------------

  def _rng(self, stream: int, step: int) -> np.random.Generator:
    return np.random.default_rng([self.seed, stream, step])

  def _draw_one(self, rng: np.random.Generator) -> tuple[str, str]:
    s = self.spec
    while True:
      k = int(rng.integers(s.min_operands, s.max_operands + 1))
      operands = rng.integers(0, s.max_operand + 1, size=k).tolist()
      ops = [s.ops[i] for i in rng.integers(0, len(s.ops), size=k - 1)]
      value = evaluate(operands, ops)
      if value < 0 and not s.allow_negative:
        continue
      width = len(str(s.max_operand)) if s.pad_operands else 0
      prompt = "".join(f"{x:0{width}d}{op}" for x, op in zip(operands, ops + ["="]))
      return prompt, str(value)[::-1] if s.reverse_answer else str(value)

  def _draw_validation(self, n: int) -> tuple[list[str], list[str]]:
    rng = self._rng(_STREAM_VAL, 0)
    seen: dict[str, str] = {}
    attempts = 0
    while len(seen) < n:
      attempts += 1
      if attempts > 100 * n + 1000:
        raise ValueError(f"ArithmeticTask: could not draw {n} distinct validation problems for {self.spec}; "
                         "lower num_val")
      p, a = self._draw_one(rng)
      seen.setdefault(p, a)
    return list(seen), list(seen.values())

  def _draw_train(self, n: int, stream: int, step: int | None) -> tuple[list[str], list[str]]:
    if n < 0:
      raise ValueError(f"ArithmeticTask: n must be >= 0, got {n}")
    if step is None:
      step = self._next_step[stream]
      self._next_step[stream] += 1
    rng = self._rng(stream, step)
    prompts, answers = [], []
    while len(prompts) < n:
      p, a = self._draw_one(rng)
      if p in self._val_set:
        continue
      prompts.append(p)
      answers.append(a)
    return prompts, answers

  # -- public API ----------------------------------------------------------------------------------------------------

  def sample(self, n: int, *, step: int | None = None) -> tuple[list[str], list[str]]:
    """``n`` training problems ``(prompts, answers)`` (answers are integer strings), never from validation.

    ``step=None`` uses an internal counter (call k of this object gives batch k); pass ``step`` explicitly to make
    batch selection stateless and resumable.
    """
    return self._draw_train(n, _STREAM_TRAIN, step)

  def supervised_examples(self, n: int, *, step: int | None = None, seq_len: int | None = None) -> SupervisedBatch:
    """``n`` warm-start examples (see ``SupervisedBatch``), padded to ``seq_len`` (default ``max_seq_len``).

    Drawn from their own stream, so warm-start data do not shift the RL batches; never from validation.
    """
    seq_len = self.max_seq_len if seq_len is None else seq_len
    if seq_len < self.max_seq_len:
      raise ValueError(f"supervised_examples: seq_len={seq_len} < max_seq_len={self.max_seq_len} of this task")
    prompts, answers = self._draw_train(n, _STREAM_SUPERVISED, step)
    tok = self.tokenizer
    tokens = np.full((n, seq_len), tok.pad_id, np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    plen = np.zeros((n,), np.int32)
    for i, (p, a) in enumerate(zip(prompts, answers)):
      p_ids = tok.encode(p, add_bos=True)
      a_ids = tok.encode(a, add_eos=True)
      tokens[i, :len(p_ids)] = p_ids
      tokens[i, len(p_ids):len(p_ids) + len(a_ids)] = a_ids
      mask[i, len(p_ids):len(p_ids) + len(a_ids)] = 1.0
      plen[i] = len(p_ids)
    return SupervisedBatch(tokens, mask, plen)

  def validation(self) -> tuple[list[str], list[str]]:
    """The fixed held-out ``(prompts, answers)``."""
    return list(self.val_prompts), list(self.val_answers)

  def encode_prompts(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Left-aligned ``[bos] + prompt`` ids padded to ``max_prompt_len``: ``(ids_NxP int32, len_N int32)``."""
    ids = np.full((len(prompts), self.max_prompt_len), self.tokenizer.pad_id, np.int32)
    lens = np.zeros((len(prompts),), np.int32)
    for i, p in enumerate(prompts):
      e = self.tokenizer.encode(p, add_bos=True)
      if len(e) > self.max_prompt_len:
        raise ValueError(f"encode_prompts: prompt {p!r} is {len(e)} tokens > max_prompt_len={self.max_prompt_len}")
      ids[i, :len(e)] = e
      lens[i] = len(e)
    return ids, lens

  @property
  def max_seq_len(self) -> int:
    return self.max_prompt_len + self.max_answer_len

  def state(self) -> dict:
    """Counters of the ``step=None`` draws, for checkpoints."""
    return {"seed": self.seed, "train_step": self._next_step[_STREAM_TRAIN],
            "supervised_step": self._next_step[_STREAM_SUPERVISED]}

  def load_state(self, state: dict) -> None:
    for key in ("seed", "train_step", "supervised_step"):
      if key not in state:
        raise KeyError(f"ArithmeticTask.load_state: missing key {key!r} (got {sorted(state)})")
    if state["seed"] != self.seed:
      raise ValueError(f"ArithmeticTask.load_state: state seed {state['seed']} != task seed {self.seed}")
    self._next_step[_STREAM_TRAIN] = int(state["train_step"])
    self._next_step[_STREAM_SUPERVISED] = int(state["supervised_step"])

  def reward(self, completion_text: str, answer: str) -> float:
    """1.0 iff the completion (decoded up to EOS) is exactly the answer: the integer (``rewards.arithmetic_reward``),
    or, for reversed answers, the digit string itself (leading zeros of a reversed number are significant)."""
    if self.spec.reverse_answer:
      return 1.0 if completion_text.strip() == answer else 0.0
    return rewards.arithmetic_reward(completion_text, answer)
