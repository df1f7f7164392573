"""Verifiable rewards (host side): math answers through math-verify, and the embedded arithmetic task.

Rewards are binary (1.0 correct, 0.0 otherwise) and never raise on bad model output: a malformed completion, an
unparsable answer or a timeout is simply 0.0. They raise only on programming errors (mismatched batch lengths).

Timeouts. math-verify guards its sympy calls with ``signal.alarm``, which (1) only works in the main thread -- in
any other thread it raises ``ValueError`` -- and (2) has whole-second resolution and restarts for every parse and
comparison, so one sample can take several times the limit. ``math_reward`` therefore disables math-verify's own
alarms and enforces one budget for the whole sample itself:

* in the main thread (POSIX): a ``setitimer(ITIMER_REAL)`` budget of ``timeout_s`` (float) around parse + verify.
  The alarm raises a ``BaseException`` subclass, so it passes through math-verify's ``except Exception`` handlers,
  and it re-fires every 50 ms until it escapes, in case some sympy code swallows it with a bare ``except:``;
* in any other thread (e.g. a reward thread overlapping the sampler): the sample runs in a spawned worker process,
  whose main thread uses the timer above; the caller waits at most ``timeout_s`` plus a margin, and a worker that
  does not answer is killed.

``score_batch(..., num_workers=N)`` spreads a batch over N spawned worker processes (the same workers), which is
also how to use more cores for a large batch.

Your own reward. A prompt-file run (``task = "math"``) scores completions with the function ``data.reward`` names:
``"math"`` (``math_reward``, the default) or ``"package.module:function"``, any importable function
``(completion: str, answer: str) -> float`` (``completion`` is the completion's text without special tokens such as
its stop token; ``answer`` is the prompt file's ``data.answer_field``). It runs in the trainer's process, on every
completion of every step and validation; it must return a finite number (GRPO normalizes within each prompt's group,
so any scale works), and an exception it raises stops the run naming it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import signal
import threading
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

# Extra wall time a caller waits for a worker process beyond the per-sample budget (process start-up, pickling).
_WORKER_MARGIN_S = 2.0
_WORKER_STARTUP_S = 60.0


# ------------------------------------------------------------------------------------------------------------------
# Answer extraction
# ------------------------------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_last_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if there is none.

  Only the last box counts: models often box intermediate results, and the final answer is the one at the end.
  An unterminated last box (truncated output) counts as no answer.
  """
  starts = [m.end() for m in _BOXED_RE.finditer(text)]
  for start in reversed(starts):
    depth = 1
    for i in range(start, len(text)):
      c = text[i]
      if c == "{":
        depth += 1
      elif c == "}":
        depth -= 1
        if depth == 0:
          return text[start:i].strip()
    return None  # the last box is not closed: no answer (do not fall back to an earlier box)
  return None


# ------------------------------------------------------------------------------------------------------------------
# math-verify with one wall-clock budget per sample
# ------------------------------------------------------------------------------------------------------------------


class RewardTimeout(BaseException):
  """Raised by the interval timer; a BaseException so that library ``except Exception`` blocks do not eat it."""


class _DropNoTimeoutWarning(logging.Filter):
  """math-verify warns once that its timeouts are off; here that is deliberate (we enforce our own)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_name).addFilter(_DropNoTimeoutWarning())


def _verify_math(pred: str, gold: str) -> bool:
  """math-verify on two boxed strings, with its own alarms off (the caller enforces the budget)."""
  import math_verify  # deferred: sympy import is slow and only the math reward needs it

  gold_parsed = math_verify.parse("\\boxed{" + gold + "}", parsing_timeout=None)
  if not gold_parsed:
    return False
  pred_parsed = math_verify.parse("\\boxed{" + pred + "}", parsing_timeout=None)
  if not pred_parsed:
    return False
  return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _call_with_itimer(fn: Callable[[], float], timeout_s: float) -> float:
  """Run ``fn`` under a SIGALRM interval timer; 0.0 if it runs out of time. Main thread, POSIX only."""
  armed = [True]  # the handler raises only while fn runs, never during the clean-up below

  def handler(signum, frame):
    if armed[0]:
      raise RewardTimeout()

  old_handler = signal.signal(signal.SIGALRM, handler)
  try:
    # First shot after timeout_s, then every 50 ms until the exception escapes (see module docstring).
    signal.setitimer(signal.ITIMER_REAL, timeout_s, 0.05)
    try:
      return fn()
    finally:
      armed[0] = False
      signal.setitimer(signal.ITIMER_REAL, 0.0)
  except RewardTimeout:
    armed[0] = False
    log.warning("math reward timed out after %.2fs", timeout_s)
    return 0.0
  finally:
    armed[0] = False
    signal.setitimer(signal.ITIMER_REAL, 0.0)
    signal.signal(signal.SIGALRM, old_handler)


def _math_reward_here(completion_text: str, answer_text: str, timeout_s: float) -> float:
  pred = extract_last_boxed(completion_text)
  if pred is None or not pred:
    return 0.0
  gold = str(answer_text).strip()
  if not gold:
    return 0.0

  def run() -> float:
    try:
      return 1.0 if _verify_math(pred, gold) else 0.0
    except Exception:  # malformed math in the model output is a wrong answer, not a crash
      log.debug("math-verify failed on %r vs %r", pred, gold, exc_info=True)
      return 0.0

  if os.name == "posix" and timeout_s is not None and timeout_s > 0:
    return _call_with_itimer(run, float(timeout_s))
  return run()


def math_reward(completion_text: str, answer_text: str, timeout_s: float = 5.0) -> float:
  """1.0 if the last ``\\boxed{...}`` of the completion equals ``answer_text`` per math-verify, else 0.0.

  ``answer_text`` is a bare answer as datasets store it (``"\\frac{1}{2}"``, ``"0.5"``, ``"34"``); it is boxed
  before parsing so both sides go through the same LaTeX path. Equivalences math-verify accepts include
  ``\\frac{1}{2}`` vs ``0.5`` vs ``1/2``, ``\\dfrac``, ``3`` vs ``3.0``, ``1,000`` vs ``1000``, sets in any order.
  No box, an empty box, an unparsable box, or more than ``timeout_s`` seconds (parse + verify together): 0.0.
  Safe to call from any thread (see the module docstring for how the timeout is enforced).
  """
  if threading.current_thread() is threading.main_thread() or os.name != "posix":
    return _math_reward_here(completion_text, answer_text, timeout_s)
  return _WorkerPool.get(1).run_one(_math_reward_here, (completion_text, answer_text, timeout_s), timeout_s)


REWARDS = {"math": math_reward}


def resolve_reward(spec: str, key: str = "data.reward") -> Callable[[str, str], float]:
  """The reward function a config names: a name of ``REWARDS`` or ``"package.module:function"`` (module docstring).
  Errors name ``key`` and say what is wrong (no such module or attribute, not callable)."""
  import importlib  # noqa: PLC0415

  if not isinstance(spec, str) or not spec:
    raise ValueError(f"{key}={spec!r} must be one of {sorted(REWARDS)} or 'package.module:function'")
  if spec in REWARDS:
    return REWARDS[spec]
  module, sep, name = spec.partition(":")
  if not sep or not module or not name:
    raise ValueError(f"{key}={spec!r} is not one of {sorted(REWARDS)} and not of the form "
                     f"'package.module:function' (a function (completion: str, answer: str) -> float)")
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"{key}={spec!r}: module {module!r} cannot be imported ({e}); is it on PYTHONPATH?") from e
  fn = mod
  for part in name.split("."):
    if not hasattr(fn, part):
      raise ValueError(f"{key}={spec!r}: {module!r} has no attribute {name!r}")
    fn = getattr(fn, part)
  if not callable(fn):
    raise ValueError(f"{key}={spec!r}: {module}.{name} is a {type(fn).__name__}, not a function "
                     f"(completion: str, answer: str) -> float")
  return fn


# ------------------------------------------------------------------------------------------------------------------
# Arithmetic (the embedded task)
# ------------------------------------------------------------------------------------------------------------------

_INT_RE = re.compile(r"[+-]?\d+")


def arithmetic_reward(completion_text: str, answer_text: str | int, *, marker: str | None = None) -> float:
  """1.0 if the completion's answer is exactly the integer ``answer_text``, else 0.0.

  The answer is the text after the *last* ``marker`` (the whole completion when ``marker`` is None, which is how
  the embedded task works: the prompt ends in ``=`` and the model writes only the number), stripped of
  whitespace; it must be a plain integer (optional sign, digits; leading zeros allowed). Anything else -- extra
  words, a second number, a missing marker -- is wrong: the tiny task rewards exactly the format it trains.
  """
  text = completion_text
  if marker is not None:
    pos = text.rfind(marker)
    if pos < 0:
      return 0.0
    text = text[pos + len(marker):]
  text = text.strip()
  if not _INT_RE.fullmatch(text):
    return 0.0
  gold = str(answer_text).strip()
  if not _INT_RE.fullmatch(gold):
    raise ValueError(f"arithmetic_reward: answer {answer_text!r} is not an integer")
  return 1.0 if int(text) == int(gold) else 0.0


# ------------------------------------------------------------------------------------------------------------------
# Batches and worker processes
# ------------------------------------------------------------------------------------------------------------------


class _WorkerPool:
  """Spawned worker processes for rewards, created lazily, replaced when one hangs, closed at exit.

  "spawn" (not fork): the parent runs JAX threads, and forking a multithreaded process can deadlock the child.
  """

  _pools: dict[int, "_WorkerPool"] = {}
  _lock = threading.Lock()

  def __init__(self, n: int):
    self.n = n
    self.pool = multiprocessing.get_context("spawn").Pool(n)
    self.started = False

  @classmethod
  def get(cls, n: int) -> "_WorkerPool":
    with cls._lock:
      p = cls._pools.get(n)
      if p is None:
        p = cls._pools[n] = _WorkerPool(n)
      return p

  @classmethod
  def discard(cls, n: int) -> None:
    with cls._lock:
      p = cls._pools.pop(n, None)
    if p is not None:
      p.pool.terminate()

  @classmethod
  def close_all(cls) -> None:
    for n in list(cls._pools):
      cls.discard(n)

  def _wait_s(self, timeout_s: float | None) -> float | None:
    if timeout_s is None or timeout_s <= 0:
      return None
    wait = timeout_s + _WORKER_MARGIN_S
    return wait if self.started else wait + _WORKER_STARTUP_S

  def run_one(self, fn, args, timeout_s):
    return self.run_many(fn, [args], timeout_s)[0]

  def run_many(self, fn, args_list, timeout_s) -> list[float]:
    results = [self.pool.apply_async(fn, a) for a in args_list]
    out, hung = [], False
    for res in results:
      if hung:
        out.append(0.0)
        continue
      try:
        # Per-result wait: the workers also time themselves out, so this only catches a worker that is stuck.
        out.append(float(res.get(self._wait_s(timeout_s))))
        self.started = True
      except multiprocessing.TimeoutError:
        log.warning("reward worker did not answer within %.1fs; restarting the worker pool", timeout_s)
        hung = True
        out.append(0.0)
    if hung:
      _WorkerPool.discard(self.n)
    return out


atexit.register(_WorkerPool.close_all)


def _call_reward(fn, completion, answer, timeout_s):
  """Worker-side call; module level so that it pickles by reference."""
  if timeout_s is not None and fn is math_reward:
    return fn(completion, answer, timeout_s=timeout_s)
  return fn(completion, answer)


def score_batch(completions: Sequence[str], answers: Sequence[str], fn: Callable[[str, str], float] = math_reward,
                *, num_workers: int = 0, timeout_s: float | None = None) -> np.ndarray:
  """Rewards of a batch as a float32 ``(N,)`` array: ``fn(completions[i], answers[i])``.

  ``num_workers == 0`` runs in this process (from the main thread, math_reward's own timer applies; from another
  thread each math sample goes to a worker process). ``num_workers > 0`` runs the batch on that many spawned worker
  processes; ``fn`` must then be picklable (a module-level function, or ``functools.partial`` of one). ``timeout_s``
  is passed to ``math_reward`` (other functions get no timeout argument); with workers it also bounds how long
  one result is waited for before the pool is presumed stuck, restarted, and the remaining samples score 0.
  """
  if len(completions) != len(answers):
    raise ValueError(f"score_batch: {len(completions)} completions but {len(answers)} answers")
  if num_workers < 0:
    raise ValueError(f"score_batch: num_workers must be >= 0, got {num_workers}")
  if num_workers == 0:
    scores = [_call_reward(fn, c, a, timeout_s) for c, a in zip(completions, answers)]
  else:
    wait = timeout_s if timeout_s is not None else 5.0
    pool = _WorkerPool.get(num_workers)
    scores = pool.run_many(_call_reward, [(fn, c, a, timeout_s) for c, a in zip(completions, answers)], wait)
  out = np.asarray(scores, np.float32)
  bad = ~np.isfinite(out)
  if bad.any():
    raise ValueError(f"score_batch: reward function {getattr(fn, '__name__', fn)!r} returned non-finite values "
                     f"at indices {np.flatnonzero(bad)[:8].tolist()}")
  return out
