"""Tests for fp8jax.rl.tasks: tokenizer, problem generation, determinism, held-out validation, warm-start data."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8jax.rl import tasks


class TestCharTokenizer:

  def test_specials_and_size(self):
    tok = tasks.CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(tasks.DEFAULT_CHARS) <= 128
    for c in "0123456789+-*=":
      assert tok.encode(c)[0] >= 3

  @settings(max_examples=50, deadline=None)
  @given(st.text(alphabet=tasks.DEFAULT_CHARS, max_size=30))
  def test_roundtrip(self, text):
    tok = tasks.CharTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.pad_id] * 3) == text

  def test_decode_stops_at_eos(self):
    tok = tasks.CharTokenizer()
    ids = tok.encode("12") + [tok.eos_id] + tok.encode("34")
    assert tok.decode(ids) == "12"
    assert tok.decode(ids, stop_at_eos=False) == "1234"
    assert tok.decode(np.array([[tok.bos_id] + tok.encode("7")])) == "7"

  def test_errors_name_the_thing(self):
    tok = tasks.CharTokenizer()
    with pytest.raises(ValueError, match="'x' at position 2"):
      tok.encode("12x")
    with pytest.raises(ValueError, match="token id 500"):
      tok.decode([500])
    with pytest.raises(ValueError, match="duplicate"):
      tasks.CharTokenizer("112")
    with pytest.raises(ValueError, match="> 128"):
      tasks.CharTokenizer("".join(chr(i) for i in range(200, 330)))


class TestEvaluate:

  @pytest.mark.parametrize("operands,ops", [
      ([12, 7, 3], ["+", "*"]), ([5, 3, 2, 4], ["-", "*", "+"]), ([2, 3, 4], ["*", "*"]), ([9, 9], ["-"]),
      ([1, 2, 3, 4, 5], ["*", "-", "*", "+"]),
  ])
  def test_matches_python(self, operands, ops):
    expr = "".join(f"{x}{op}" for x, op in zip(operands, ops + [""]))
    assert tasks.evaluate(operands, ops) == eval(expr)  # noqa: S307 - test oracle on generated digits only

  def test_arity_error(self):
    with pytest.raises(ValueError, match="3 operands need 2 operators"):
      tasks.evaluate([1, 2, 3], ["+"])


class TestArithmeticTask:

  def test_format_and_answers(self):
    for level in tasks.DIFFICULTY:
      task = tasks.ArithmeticTask(seed=0, difficulty=level)
      prompts, answers = task.sample(64)
      rev = task.spec.reverse_answer
      for p, a in zip(prompts, answers):
        assert p.endswith("=")
        value = int(a[::-1]) if rev else int(a)
        assert eval(re.sub(r"\b0+(?=\d)", "", p[:-1])) == value  # noqa: S307 (zero-padded operands: "07+48")
        assert value >= 0
        assert task.reward(a, a) == 1.0
        wrong = str(value + 1)[::-1] if rev else str(value + 1)
        assert task.reward(wrong, a) == 0.0
        ids = task.tokenizer.encode(p, add_bos=True)
        assert len(ids) <= task.max_prompt_len
        assert len(task.tokenizer.encode(a, add_eos=True)) <= task.max_answer_len

  def test_reversed_answers_compare_digit_strings(self):
    task = tasks.ArithmeticTask(seed=0, difficulty=5)
    assert task.spec.reverse_answer
    # 37 + 48 = 85 is written "58"; 40 + 30 = 70 is "07", and "7" (which is 7, not 70) must not count
    assert task.reward("58", "58") == 1.0 and task.reward("85", "58") == 0.0
    assert task.reward("07", "07") == 1.0 and task.reward("7", "07") == 0.0

  def test_padded_operands_sit_at_fixed_offsets(self):
    task = tasks.ArithmeticTask(seed=0, difficulty=6)
    prompts, answers = task.sample(200)
    for p, a in zip(prompts, answers):
      assert re.fullmatch(r"\d\d\+\d\d=", p), p
      x, y = int(p[:2]), int(p[3:5])
      assert a == str(x + y)[::-1]  # the answer is not padded: 07 + 02 = 9 is "9"
    assert any(p[0] == "0" for p in prompts) and any(p[3] == "0" for p in prompts)
    assert len(task.tokenizer.encode(prompts[0], add_bos=True)) == task.max_prompt_len

  def test_answers_are_short(self):
    task = tasks.ArithmeticTask(seed=0, difficulty=1)
    _, answers = task.sample(500)
    assert max(len(a) for a in answers) <= 3

  def test_deterministic_from_seed_and_step(self):
    a = tasks.ArithmeticTask(seed=3)
    b = tasks.ArithmeticTask(seed=3)
    assert a.sample(16) == b.sample(16)
    assert a.sample(16) == b.sample(16)
    assert a.sample(16, step=7) == b.sample(16, step=7)
    assert a.validation() == b.validation()
    c = tasks.ArithmeticTask(seed=4)
    assert c.sample(16, step=0) != a.sample(16, step=0)
    assert c.validation() != a.validation()

  def test_counter_and_state_resume(self):
    a = tasks.ArithmeticTask(seed=1)
    first = [a.sample(8) for _ in range(3)]
    assert first[1] == a.sample(8, step=1)  # implicit counter == explicit step
    state = a.state()
    nxt = a.sample(8)
    b = tasks.ArithmeticTask(seed=1)
    b.load_state(state)
    assert b.sample(8) == nxt
    with pytest.raises(ValueError, match="seed"):
      tasks.ArithmeticTask(seed=2).load_state(state)
    with pytest.raises(KeyError, match="train_step"):
      b.load_state({"seed": 1})

  def test_validation_held_out(self):
    task = tasks.ArithmeticTask(seed=0, difficulty=0)  # small space: 100 problems, 25 held out
    vp, va = task.validation()
    assert len(vp) == 25 == len(set(vp))
    seen = set()
    for step in range(20):
      p, _ = task.sample(50, step=step)
      seen.update(p)
      sb = task.supervised_examples(20, step=step)
      for row, n in zip(sb.tokens_NxL, sb.prompt_len_N):
        seen.add(task.tokenizer.decode(row[:n]))
    assert not seen & set(vp)
    assert len(seen) == 75  # everything else is reachable

  def test_num_val_bounds(self):
    with pytest.raises(ValueError, match="num_val=60"):
      tasks.ArithmeticTask(difficulty=0, num_val=60)
    with pytest.raises(ValueError, match="difficulty=9"):
      tasks.ArithmeticTask(difficulty=9)
    assert len(tasks.ArithmeticTask(difficulty=1, num_val=10).validation()[0]) == 10

  def test_custom_spec(self):
    spec = tasks.ArithmeticSpec(3, 4, 5, "+-", allow_negative=True)
    task = tasks.ArithmeticTask(seed=0, difficulty=spec)
    p, a = task.sample(200)
    assert any(int(x) < 0 for x in a)
    assert all(3 <= len([c for c in q if c in "+-"]) + 1 <= 4 for q in p)
    with pytest.raises(ValueError, match="ops"):
      tasks.ArithmeticSpec(ops="+/")
    with pytest.raises(ValueError, match="min_operands"):
      tasks.ArithmeticSpec(min_operands=1)

  def test_supervised_examples(self):
    task = tasks.ArithmeticTask(seed=0)
    sb = task.supervised_examples(32)
    tok = task.tokenizer
    assert sb.tokens_NxL.shape == (32, task.max_seq_len) and sb.tokens_NxL.dtype == np.int32
    assert sb.loss_mask_NxL.shape == sb.tokens_NxL.shape
    for row, m, n in zip(sb.tokens_NxL, sb.loss_mask_NxL, sb.prompt_len_N):
      assert row[0] == tok.bos_id
      prompt = tok.decode(row[:n])
      answer_ids = row[m > 0]
      assert answer_ids[-1] == tok.eos_id
      answer = tok.decode(answer_ids)
      assert eval(prompt[:-1]) == int(answer)  # noqa: S307
      # Everything after the eos is padding, and the mask covers exactly answer + eos right after the prompt.
      end = n + len(answer_ids)
      assert np.all(m[n:end] == 1) and np.all(m[:n] == 0) and np.all(m[end:] == 0)
      assert np.all(row[end:] == tok.pad_id)
    # Its own stream: warm-start draws do not move the RL batches.
    t2 = tasks.ArithmeticTask(seed=0)
    assert t2.sample(8, step=0) == tasks.ArithmeticTask(seed=0).sample(8, step=0)
    with pytest.raises(ValueError, match="seq_len"):
      task.supervised_examples(2, seq_len=3)

  def test_encode_prompts(self):
    task = tasks.ArithmeticTask(seed=0)
    ids, lens = task.encode_prompts(["1+2=", "10+20="])
    assert ids.shape == (2, task.max_prompt_len)
    assert lens.tolist() == [5, 7]
    assert task.tokenizer.decode(ids[1]) == "10+20="

  def test_difficulty_space_sizes(self):
    assert tasks.DIFFICULTY[0].num_problems_upper_bound == 100
    assert tasks.DIFFICULTY[1].num_problems_upper_bound == 10_000
    # Enumerate level 0 exhaustively: all answers fit in max_answer_len.
    task = tasks.ArithmeticTask(difficulty=0)
    for x, y in itertools.product(range(10), repeat=2):
      assert len(str(x + y)) + 1 <= task.max_answer_len
