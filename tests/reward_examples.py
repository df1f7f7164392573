"""Reward functions a test names by ``data.reward = "reward_examples:NAME"`` (tests/test_source.py), as a user names
theirs: importable module-level functions ``(completion: str, answer: str) -> float``."""

NOT_CALLABLE = 3.0


def answer_in_completion(completion: str, answer: str) -> float:
  """1.0 when the answer's text occurs anywhere in the completion (no \\boxed{} needed), plus 0.5 per 'the'."""
  return float(answer in completion) + 0.5 * completion.count("the")


def raises(completion: str, answer: str) -> float:
  raise KeyError("a bug in the user's reward")


def not_finite(completion: str, answer: str) -> float:
  return float("nan")


def exact(completion: str, answer: str) -> float:
  """1.0 only when the completion's text is exactly the answer (sensitive to anything else in it)."""
  return float(completion == answer)
