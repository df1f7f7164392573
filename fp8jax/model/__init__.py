"""The model function (Llama-3.x / Qwen3, dense or MoE), its chunked output head, its config and its parameter schema.

The names below are imported on first use (PEP 562): importing ``fp8jax.model.schema`` (as ``recipes`` and
``sharding`` do, for the parameter layout) does not pull in the model code and the kernels behind it.
"""

import importlib as _importlib

_EXPORTS = {
    "ModelConfig": "config", "num_params": "schema", "param_shapes": "schema", "ForwardAux": "llama",
    "forward": "llama", "init_params": "llama", "logits": "llama", "next_token_logprobs": "llama",
    "logits_and_lse": "head", "logprobs_and_entropy": "head", "token_logprob": "head",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(_importlib.import_module(f"fp8jax.model.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'fp8jax.model' has no attribute {name!r}")
