"""The one way a config group (ConfigDict or dict) becomes a frozen dataclass: unknown keys fail, naming the group."""

from __future__ import annotations

import dataclasses
from typing import Any


def dataclass_from_group(cls, group: Any, name: str):
  """``cls(**group)``; lists become tuples (hashable, for jit statics); an unknown key raises naming ``name.key``."""
  d = dict(group)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ValueError(f"unknown {name} config keys: {unknown} (known: {sorted(fields)})")
  return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
