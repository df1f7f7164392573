"""The prompt-source interface (fp8jax.rl.source): both sources follow its rules; the loop's data position.

CPU, no model: the math source runs on a local jsonl file and the tiny BPE tokenizer of fp8jax.hf.
"""

import fp8jax

import json
import os
import sys
import types

import numpy as np
import pytest

from configs import llama8b_fp8
from fp8jax import hf
from fp8jax.rl import data, rewards, source
from fp8jax.rl import trainer as trainer_lib
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


def _rollout(tok, texts):
  """A sampler.Rollout's fields the sources read: right-padded token rows and their lengths."""
  ids = [tok.encode(t, add_special_tokens=False) for t in texts]
  tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for i, row in enumerate(ids):
    tokens[i, :len(row)] = row
  return types.SimpleNamespace(tokens=tokens, lengths=np.array([len(r) for r in ids]))


def test_data_reward_names_the_users_own_function(math_config):
  """data.reward = "package.module:function" scores every completion with that function (here one that needs no
  \\boxed{}, so math-verify's scores differ); "math" is math-verify's."""
  c = math_config.copy_and_resolve_references()
  c.data.reward = "reward_examples:answer_in_completion"
  src = MathSource(c)
  assert src.reward_fn is rewards.resolve_reward(c.data.reward)
  texts = ["the answer is four", "two plus two is four", "so two"]  # words the tiny tokenizer round-trips
  ro = _rollout(src.tok, texts)
  decoded = [src.tok.decode(list(ro.tokens[i, :ro.lengths[i]])) for i in range(len(texts))]
  assert decoded == texts
  import reward_examples  # noqa: PLC0415  (tests/ is on sys.path, as a user's package would be)

  got = src.score(ro, ["four"] * len(texts))
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, [reward_examples.answer_in_completion(t, "four") for t in texts])
  np.testing.assert_array_equal(got, [1.5, 1.0, 0.0])
  # the function gets the completion's text without special tokens: a stop token ends a sampled row
  c.data.reward = "reward_examples:exact"
  src = MathSource(c)
  ro = _rollout(src.tok, ["four", "four", "four plus"])
  ro.tokens[0, ro.lengths[0]] = src.eos_id
  ro.lengths[0] += 1  # row 0: "four" and its stop token (a sampler's length counts it)
  np.testing.assert_array_equal(src.score(ro, ["four"] * 3), [1.0, 1.0, 0.0])
  # the default, math-verify, reads only a \\boxed{} answer: none here
  np.testing.assert_array_equal(MathSource(math_config).score(ro, ["four"] * len(texts)), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("spec,match", [
    ("exact", r"data\.reward='exact' is not one of \['math'\] and not of the form 'package\.module:function'"),
    ("no_such_module_xyz:f", r"data\.reward='no_such_module_xyz:f': module 'no_such_module_xyz' cannot be imported"),
    ("reward_examples:missing", r"data\.reward='reward_examples:missing': 'reward_examples' has no attribute"),
    ("reward_examples:NOT_CALLABLE", r"reward_examples\.NOT_CALLABLE is a float, not a function"),
])
def test_a_bad_data_reward_is_named_before_work_starts(math_config, spec, match):
  c = math_config.copy_and_resolve_references()
  c.data.reward = spec
  with pytest.raises(ValueError, match=match):
    trainer_lib.validate_config(c)


@pytest.mark.parametrize("name,match", [("raises", r"KeyError: .a bug in the user's reward"),
                                        ("not_finite", r"non-finite values at indices \[0, 1\]")])
def test_a_failing_user_reward_stops_the_step_naming_data_reward(math_config, name, match):
  c = math_config.copy_and_resolve_references()
  c.data.reward = f"reward_examples:{name}"
  src = MathSource(c)
  with pytest.raises(RuntimeError, match=rf"data\.reward='reward_examples:{name}' failed while scoring 2 "
                                         rf"completions: .*{match}"):
    src.score(_rollout(src.tok, ["a", "b"]), ["1", "2"])


class FlatRewardSource:
  """A user's own task, passed as RLTrainer(..., source=it): the arithmetic prompts, a reward of its own (every
  completion 0.25, so every group agrees), and a state of its own in the checkpoints."""

  def __init__(self, config, tag="mine"):
    self.inner = source.ArithmeticSource(config)
    self.pad_id, self.eos_ids, self.tag = self.inner.pad_id, self.inner.eos_ids, tag
    self.scored = []

  def train_prompts(self, n, step):
    return self.inner.train_prompts(n, step)

  def validation(self, n):
    return self.inner.validation(n)

  def score(self, ro, answers):
    self.scored.append(len(answers))
    return np.full(len(answers), 0.25, np.float32)

  def supervised_examples(self, n, step, seq_len):
    return self.inner.supervised_examples(n, step, seq_len)

  def state(self):
    return {"my_task": self.tag}

  def load_state(self, meta):
    if meta.get("my_task") != self.tag:
      raise ValueError(f"checkpoint of task {meta.get('my_task')!r}, not {self.tag!r}")


def test_a_users_own_source_drives_the_loop_and_its_checkpoints(tmp_path):
  """RLTrainer(..., source=src) draws prompts from src, scores every rollout and validation with it, and writes its
  state() into the checkpoints (a resume with another state is refused by its load_state)."""
  c = small_config(**{"train.steps": 1})
  src = FlatRewardSource(c)
  tr = trainer_lib.RLTrainer(c, str(tmp_path), source=src)
  assert tr.task is src
  rows = tr.run(1, progress=False)
  step = next(r for r in rows if "reward_mean" in r)
  assert step["reward_mean"] == 0.25 and step["no_signal_groups_frac"] == 1.0  # its reward, groups all agree
  assert [r["val_accuracy"] for r in rows if "val_accuracy" in r] == [0.25, 0.25]  # step 0 and the last
  n_rollout = c.grpo.num_prompts * c.grpo.num_generations
  assert n_rollout in src.scored and src.scored.count(c.train.val_prompts) >= 2
  with pytest.raises(ValueError, match="checkpoint of task 'mine', not 'other'"):
    trainer_lib.RLTrainer(c, str(tmp_path), source=FlatRewardSource(c, tag="other")).restore()


def test_a_source_missing_members_or_with_foreign_token_ids_is_refused(tmp_path):
  c = small_config()
  good = FlatRewardSource(c)
  bad = types.SimpleNamespace(pad_id=0, eos_ids=(1,), train_prompts=good.train_prompts)
  with pytest.raises(TypeError, match=r"lacks \['validation', 'score', 'supervised_examples', 'state', 'load_state'\]"):
    trainer_lib.RLTrainer(c, str(tmp_path), source=bad)
  good.eos_ids = (c.model.vocab_size,)
  with pytest.raises(ValueError, match=r"token ids in \[0, model.vocab_size=\d+\)"):
    trainer_lib.RLTrainer(c, str(tmp_path), source=good)
