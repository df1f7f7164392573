"""The prompt-source interface (fp8jax.rl.source): both sources follow its rules; the loop's data position.

CPU, no model: the math source runs on a local jsonl file and the tiny BPE tokenizer of fp8jax.hf.
"""

import fp8jax

import json
import os
import sys

import pytest

from configs import llama8b_fp8
from fp8jax import hf
from fp8jax.rl import data, source
from fp8jax.rl.math_source import MathSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import small_config  # noqa: E402


@pytest.fixture(scope="module")
def math_config(tmp_path_factory):
  d = tmp_path_factory.mktemp("math")
  hf.make_tiny_tokenizer(str(d / "tok"))
  with open(d / "p.jsonl", "w") as f:
    for i in range(40):
      f.write(json.dumps({"problem": f"What is {i} plus one?", "expected_answer": str(i + 1)}) + "\n")
  c = llama8b_fp8.get_config()
  c.data.path, c.data.tokenizer_dir, c.data.val_size = str(d / "p.jsonl"), str(d / "tok"), 8
  c.grpo.num_prompts = 6
  return c


def _sources(math_config):
  return {"arithmetic": source.ArithmeticSource(small_config()), "math": MathSource(math_config)}


@pytest.mark.parametrize("name", ["arithmetic", "math"])
def test_train_prompts_is_a_pure_function_of_step(math_config, name):
  src = _sources(math_config)[name]
  n = 4
  assert isinstance(src, source.PromptSource)
  first = src.train_prompts(n, 5)
  for k in (0, 1, 9, 5, 5):  # other batches drawn in between (calibration, refills) change nothing
    src.train_prompts(n, k)
  assert src.train_prompts(n, 5) == first
  assert _sources(math_config)[name].train_prompts(n, 5) == first  # nor does the history of the object
  assert src.train_prompts(n, 6) != first
  assert src.validation(3) == src.validation(3)
  if name == "math":  # answers identify the examples (the tiny tokenizer maps unseen digits to <unk>)
    train_answers = {a for k in range(8) for a in src.train_prompts(n, k)[1]}
    assert not train_answers & set(src.validation(8)[1])  # held out


def test_math_batches_cover_an_epoch_without_repeats(math_config):
  """Batch k of the pure function is the iterator's k-th batch: an epoch visits distinct prompts."""
  src = MathSource(math_config)
  bpe = len(src.train) // src.batch_size  # 32 training prompts, batches of 6: 5 per epoch
  seen = [a for k in range(bpe) for a in src.train_prompts(src.batch_size, k)[1]]
  assert len(seen) == len(set(seen)) == bpe * src.batch_size
  it = data.PromptIterator(src.train, src.batch_size, seed=src.seed)
  for k in range(2 * bpe + 1):
    assert data.prompt_batch(src.train, src.batch_size, k, seed=src.seed) == it.next_batch()


def test_math_source_refuses_a_checkpoint_of_other_data(math_config):
  src = MathSource(math_config)
  src.load_state(src.state())
  c = math_config.copy_and_resolve_references()
  c.data.val_size = 10
  with pytest.raises(ValueError, match=r"num_examples|training split's size: 32 in the checkpoint, 30 now"):
    MathSource(c).load_state(src.state())
