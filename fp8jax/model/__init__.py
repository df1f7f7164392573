"""The model function (Llama-3.x / Qwen3 dense) and its config."""

from fp8jax.model.config import ModelConfig, num_params
from fp8jax.model.llama import (ForwardAux, forward, init_params, logits, next_token_logprobs, param_shapes,
                                token_entropy, token_logprobs)

__all__ = ["ModelConfig", "num_params", "ForwardAux", "forward", "init_params", "logits", "next_token_logprobs",
           "param_shapes", "token_entropy", "token_logprobs"]
