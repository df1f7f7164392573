"""Tests for fp8jax.rl.rewards: boxed extraction, math-verify reward, timeouts, threads, arithmetic reward."""

from __future__ import annotations

import concurrent.futures
import functools
import time

import numpy as np
import pytest

from fp8jax.rl import rewards


class TestExtractBoxed:

  @pytest.mark.parametrize("text,want", [
      ("so \\boxed{42}.", "42"),
      ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
      ("nested \\boxed{\\{1, \\{2\\}\\}} ok", "\\{1, \\{2\\}\\}"),
      ("\\boxed{ x^{2} + 1 }", "x^{2} + 1"),
      ("\\fbox{7}", "7"),
      ("no box at all: 42", None),
      ("good \\boxed{3} then truncated \\boxed{4", None),
      ("\\boxed {5}", "5"),
  ])
  def test_cases(self, text, want):
    assert rewards.extract_last_boxed(text) == want


class TestMathReward:

  @pytest.mark.parametrize("completion,answer,want", [
      ("The answer is \\boxed{42}.", "42", 1.0),
      ("The answer is \\boxed{41}.", "42", 0.0),
      ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
      ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
      ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
      ("\\boxed{3.0}", "3", 1.0),
      ("\\boxed{1000}", "1,000", 1.0),
      ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
      ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
      ("work \\boxed{1} then the final \\boxed{2}", "2", 1.0),
      ("work \\boxed{2} then the final \\boxed{1}", "2", 0.0),
      ("The answer is 42 (no box).", "42", 0.0),
      ("\\boxed{}", "42", 0.0),
      ("\\boxed{\\frac{1}{", "0.5", 0.0),
      ("\\boxed{)(*&^%$}", "42", 0.0),
      ("\\boxed{42}", "", 0.0),
  ])
  def test_cases(self, completion, answer, want):
    assert rewards.math_reward(completion, answer) == want

  def test_timeout_returns_zero(self, monkeypatch):
    def slow(pred, gold):
      t = time.time()
      while time.time() - t < 5:  # a busy loop, as a pathological sympy call would be
        pass
      return True

    monkeypatch.setattr(rewards, "_verify_math", slow)
    t0 = time.time()
    assert rewards.math_reward("\\boxed{1}", "1", timeout_s=0.3) == 0.0
    assert time.time() - t0 < 2.0

  def test_timeout_survives_bare_except(self, monkeypatch):
    def swallowing(pred, gold):
      t = time.time()
      try:
        while time.time() - t < 5:
          pass
      except BaseException:  # noqa: BLE001 - what some library code does; the re-firing timer must still win
        pass
      while time.time() - t < 5:
        pass
      return True

    monkeypatch.setattr(rewards, "_verify_math", swallowing)
    t0 = time.time()
    assert rewards.math_reward("\\boxed{1}", "1", timeout_s=0.2) == 0.0
    assert time.time() - t0 < 2.0

  def test_works_from_worker_threads(self):
    # math-verify's own signal-based timeouts fail outside the main thread; ours route to a worker process.
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
      got = list(ex.map(lambda a: rewards.math_reward("x = \\boxed{0.5}", a, timeout_s=5.0),
                        ["\\frac{1}{2}", "3"]))
    assert got == [1.0, 0.0]


class TestArithmeticReward:

  @pytest.mark.parametrize("completion,answer,want", [
      ("42", "42", 1.0),
      (" 42 \n", "42", 1.0),
      ("042", "42", 1.0),
      ("-7", "-7", 1.0),
      ("43", "42", 0.0),
      ("42 apples", "42", 0.0),
      ("4 2", "42", 0.0),
      ("", "42", 0.0),
      ("4.2", "42", 0.0),
  ])
  def test_no_marker(self, completion, answer, want):
    assert rewards.arithmetic_reward(completion, answer) == want

  def test_marker(self):
    assert rewards.arithmetic_reward("think 1+1 A: 3 A: 12", "12", marker="A:") == 1.0
    assert rewards.arithmetic_reward("12", "12", marker="A:") == 0.0
    assert rewards.arithmetic_reward("A: 12", 12, marker="A:") == 1.0

  def test_bad_gold(self):
    with pytest.raises(ValueError, match="not an integer"):
      rewards.arithmetic_reward("1", "one")


class TestScoreBatch:

  def test_in_process(self):
    out = rewards.score_batch(["\\boxed{1}", "\\boxed{2}", "none"], ["1", "3", "1"])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [1.0, 0.0, 0.0])

  def test_custom_fn(self):
    fn = functools.partial(rewards.arithmetic_reward, marker="=")
    out = rewards.score_batch(["1+1=2", "2+2=5"], ["2", "4"], fn)
    np.testing.assert_array_equal(out, [1.0, 0.0])

  def test_length_mismatch(self):
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
      rewards.score_batch(["a", "b"], ["1"])

  def test_non_finite_reward_rejected(self):
    with pytest.raises(ValueError, match="non-finite"):
      rewards.score_batch(["a"], ["1"], lambda c, a: float("nan"))

  def test_worker_processes(self):
    comps = ["\\boxed{\\frac{1}{2}}", "\\boxed{0.25}", "\\boxed{7}"]
    out = rewards.score_batch(comps, ["0.5", "\\frac{1}{4}", "8"], num_workers=2, timeout_s=5.0)
    np.testing.assert_array_equal(out, [1.0, 1.0, 0.0])
    out = rewards.score_batch(["12"], ["12"], rewards.arithmetic_reward, num_workers=2)
    np.testing.assert_array_equal(out, [1.0])
