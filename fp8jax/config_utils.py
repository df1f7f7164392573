"""Configs: the one way a config group (ConfigDict or dict) becomes a frozen dataclass (unknown keys fail, naming the
group), the one loader of a configs/*.py file outside absl's flags, and the one way code overrides its keys."""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
from typing import Any


def load_config_file(path: str):
  """``get_config()`` of a configs/*.py file (scripts that take a config path without absl's config flags)."""
  spec = importlib.util.spec_from_file_location("_fp8jax_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def override(config, overrides: dict, who: str):
  """A copy of ``config`` with ``{"group.field": value}`` set; a key the config lacks raises a KeyError naming it
  (``who``: the caller, for the message)."""
  c = copy.deepcopy(config)
  for key, value in overrides.items():
    group, _, field = key.partition(".")
    if group not in c or field not in c[group]:
      raise KeyError(f"{who}: the config has no key {key!r}")
    c[group][field] = value
  return c


def parse_sets(items: list[str]) -> dict:
  """``["group.key=VALUE", ...]`` (scripts' ``--set`` flags) as ``{"group.key": value}``: values parsed as Python
  literals, else kept as strings; an item without "=" raises a ValueError naming it."""
  overrides = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep:
      raise ValueError(f"--set {item!r}: expected KEY=VALUE")
    try:
      overrides[key] = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      overrides[key] = raw
  return overrides


def smoke_shape(c, layers: int, slots: int = 128):
  """A recipe config at its full width but ``layers`` deep, in the GRPO smoke's shape (docs/performance.md: 16 prompts
  x 8 samples of the embedded arithmetic task, 64-token sequences, 16 new tokens, microbatch 32; KL off): what
  scripts/check_loop_exactness.py and scripts/bench_grpo_step.py build from a config file, random weights."""
  with c.unlocked():
    c.task = "arithmetic"
    if "data" in c:
      c.data.path = ""  # the embedded task replaces the recipe's prompt file
    c.model.n_layers = layers
    c.grpo.num_prompts, c.grpo.num_generations, c.grpo.microbatch, c.grpo.kl_beta = 16, 8, 32, 0.0
    c.rollout.slots, c.rollout.max_len, c.rollout.max_new_tokens, c.rollout.prompt_buckets = slots, 64, 16, (16,)
  return c


def dataclass_from_group(cls, group: Any, name: str):
  """``cls(**group)``; lists become tuples (hashable, for jit statics); an unknown key raises naming ``name.key``."""
  d = dict(group)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ValueError(f"unknown {name} config keys: {unknown} (known: {sorted(fields)})")
  return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
