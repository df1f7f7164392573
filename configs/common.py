"""Shared config helpers."""


def to_bf16(c, workdir: str):
  """The BF16 baseline of an FP8 recipe: no quantization, BF16 KV cache, everything else identical."""
  c.workdir = workdir
  c.fp8.mode = "bf16"
  c.fp8.kv_cache = "bf16"
  return c
