"""Tests for fp8jax.rl.data: jsonl/parquet reading, fields and templates, split, resumable iterator."""

from __future__ import annotations

import importlib.util
import json

import pytest

from fp8jax.rl import data


def write_jsonl(path, records):
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return str(path)


@pytest.fixture
def omi_file(tmp_path):
  recs = [{"problem": f"What is {i}+1?", "generated_solution": "...", "expected_answer": str(i + 1),
           "problem_source": "augmented_math"} for i in range(10)]
  return write_jsonl(tmp_path / "omi.jsonl", recs)


@pytest.fixture
def dapo_file(tmp_path):
  recs = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"Solve {i}. Answer: $Answer"}],
           "ability": "MATH", "reward_model": {"ground_truth": str(i * 2), "style": "rule-lighteval/MATH_v2"},
           "extra_info": {"index": str(i)}} for i in range(4)]
  return write_jsonl(tmp_path / "dapo.jsonl", recs)


class TestLoad:

  def test_openmathinstruct_fields_and_template(self, omi_file):
    tmpl = "Solve the problem; put the final answer in \\boxed{}.\n{prompt}\n"
    ex = data.load_prompts(omi_file, template=tmpl, **data.OPENMATHINSTRUCT2_FIELDS)
    assert len(ex) == 10
    assert ex[3] == data.PromptExample("Solve the problem; put the final answer in \\boxed{}.\nWhat is 3+1?\n", "4", 3)

  def test_dapo_nested_answer_and_chat_prompt(self, dapo_file):
    ex = data.load_prompts(dapo_file, **data.DAPO_MATH_17K_FIELDS)
    assert ex[2].prompt == "Solve 2. Answer: $Answer"
    assert ex[2].answer == "4"

  def test_numeric_answer_and_max_examples(self, tmp_path):
    p = write_jsonl(tmp_path / "n.jsonl", [{"q": "a", "a": 3}, {"q": "b", "a": 0.5}, {"q": "c", "a": "x"}])
    ex = data.load_prompts(p, prompt_field="q", answer_field="a", max_examples=2)
    assert [e.answer for e in ex] == ["3", "0.5"]

  def test_missing_field_names_file_row_field(self, tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "x", "expected_answer": "1"}, {"problem": "y"}])
    with pytest.raises(KeyError, match=r"bad\.jsonl row 1: missing field 'expected_answer'"):
      data.load_prompts(p)
    with pytest.raises(KeyError, match="missing field 'reward_model.ground_truth'"):
      data.load_prompts(p, answer_field="reward_model.ground_truth")

  def test_bad_values(self, tmp_path):
    p = write_jsonl(tmp_path / "v.jsonl", [{"problem": 5, "expected_answer": "1"}])
    with pytest.raises(ValueError, match="prompt must be a string"):
      data.load_prompts(p)
    p = write_jsonl(tmp_path / "w.jsonl", [{"problem": "x", "expected_answer": None}])
    with pytest.raises(ValueError, match="answer must be"):
      data.load_prompts(p)

  def test_file_errors(self, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
      data.load_prompts(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported dataset file type"):
      data.read_records(str(tmp_path / "x.csv"))
    (tmp_path / "broken.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: invalid JSON"):
      data.read_records(str(tmp_path / "broken.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
      data.load_prompts(str(tmp_path / "empty.jsonl"))

  def test_template_needs_placeholder(self, omi_file):
    with pytest.raises(ValueError, match="must contain '{prompt}'"):
      data.load_prompts(omi_file, template="no placeholder")

  def test_parquet(self, tmp_path):
    path = str(tmp_path / "d.parquet")
    if importlib.util.find_spec("pyarrow") is None:
      open(path, "wb").close()
      with pytest.raises(ImportError, match="needs pyarrow"):
        data.read_records(path)
      return
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"problem": "p", "expected_answer": "1"}]), path)
    assert data.load_prompts(path)[0].answer == "1"


def examples(n):
  return [data.PromptExample(f"p{i}", str(i), i) for i in range(n)]


class TestSplit:

  def test_deterministic_disjoint_complete(self):
    ex = examples(50)
    tr, va = data.train_val_split(ex, 10, seed=1)
    tr2, va2 = data.train_val_split(ex, 10, seed=1)
    assert (tr, va) == (tr2, va2)
    assert len(va) == 10 and len(tr) == 40
    assert {e.index for e in tr} | {e.index for e in va} == set(range(50))
    assert not {e.index for e in tr} & {e.index for e in va}
    assert [e.index for e in va] == sorted(e.index for e in va)
    assert data.train_val_split(ex, 10, seed=2)[1] != va

  def test_fraction_and_errors(self):
    assert len(data.train_val_split(examples(20), 0.25)[1]) == 5
    with pytest.raises(ValueError, match="no training data"):
      data.train_val_split(examples(5), 5)
    with pytest.raises(ValueError, match="fractional"):
      data.train_val_split(examples(5), 1.5)


class TestPromptIterator:

  def test_epochs_cover_and_reshuffle(self):
    ex = examples(10)
    it = data.PromptIterator(ex, 3, seed=0)
    assert it.batches_per_epoch == 3
    epoch0 = [e.index for _ in range(3) for e in it.next_batch()]
    assert len(set(epoch0)) == 9  # one example of the epoch skipped (10 % 3)
    epoch1 = [e.index for _ in range(3) for e in it.next_batch()]
    assert len(set(epoch1)) == 9 and epoch1 != epoch0
    assert it.state()["epoch"] == 1

  def test_deterministic(self):
    a = data.PromptIterator(examples(7), 2, seed=5)
    b = data.PromptIterator(examples(7), 2, seed=5)
    assert [next(a) for _ in range(9)] == [next(b) for _ in range(9)]

  def test_resume_equals_uninterrupted(self):
    ex = examples(11)
    full = data.PromptIterator(ex, 4, seed=3)
    want = [full.next_batch() for _ in range(8)]
    part = data.PromptIterator(ex, 4, seed=3)
    got = [part.next_batch() for _ in range(3)]
    state = json.loads(json.dumps(part.state()))  # survives a round trip through a checkpoint file
    resumed = data.PromptIterator.from_state(ex, state)
    got += [resumed.next_batch() for _ in range(5)]
    assert got == want

  def test_from_state_errors(self):
    it = data.PromptIterator(examples(8), 2)
    st = it.state()
    with pytest.raises(ValueError, match="saved for 8 examples but 9"):
      data.PromptIterator.from_state(examples(9), st)
    with pytest.raises(KeyError, match="'epoch'"):
      data.PromptIterator.from_state(examples(8), {k: v for k, v in st.items() if k != "epoch"})

  def test_constructor_errors(self):
    with pytest.raises(ValueError, match="batch_size=5"):
      data.PromptIterator(examples(4), 5)
    with pytest.raises(ValueError, match="batch boundary"):
      data.PromptIterator(examples(8), 2, index=3)
