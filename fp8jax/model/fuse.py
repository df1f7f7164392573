"""Fused projections: the linear weights that read the same input, concatenated along N into one GEMM.

Groups: q/k/v of GQA attention (``wq+wk+wv``) and gate/up of a SwiGLU MLP (``w_gate+w_up``; DeepSeek's shared
experts ``shared_gate+shared_up``). The parameter schema keeps them apart (one row per HF module: checkpoints,
sharding, the optimizer, the trainer); ``fuse_layers`` builds the fused form from it for the sampler, and the model
function runs a group as one GEMM where its layer holds the fused key (``project``), else one GEMM per weight.

Why only where ``fusable`` says so: the fused GEMM's column block [n0, n0 + N_i) must be bitwise the separate GEMM
of weight i, or the sampler's rows would stop being the trainer's. The Hopper kernels (``pallas_kernels.fp8_gemm_mgpu``)
compute every output element with the same chain of wgmma steps whatever N and wherever the element lies (the same
property as ``head.whole_vocab_gemm``'s), and weights of whole 128-row blocks keep every 128 x 128 FP8 block and its
scale as they were. XLA:CPU's matmul blocking follows N, so there (and for master weights quantized inside the op,
for weights of different kinds or rows not a multiple of 128, and on a multi-device mesh, whose column-parallel
shards would mix q, k and v rows) the group stays separate: the same results either way.

What it saves at Llama-3.1-8B, decode M = 256 (H200): q, k, v are one-wave GEMMs of 64, 16 and 16 output tiles on
132 SMs, fused one wave of 96; 96 fewer kernel launches per decode step (docs/history.md has the measurement).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fp8jax import lora, ops, quant, sharding
from fp8jax.model.schema import BIAS_OF, PARALLEL

GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"), ("shared_gate", "shared_up"))


def fused_key(names) -> str:
  return "+".join(names)


def fusable(ws, lcfg: ops.LinearConfig) -> bool:
  """Whether the weights ``ws`` (one group, in order) may run as one GEMM with the same bits (module docstring)."""
  if sharding.multi_device(lcfg.mesh):
    return False
  kind = type(ws[0])
  if kind is lora.LoRAWeight:
    return False  # adapters: three GEMMs per weight (fp8jax.lora), nothing stored to concatenate
  if any(type(w) is not kind for w in ws) or len({w.shape[1] for w in ws}) != 1:
    return False
  if any(w.shape[0] % quant.BLOCK for w in ws):
    return False
  if kind is quant.FP8Weight:
    return False  # master weights are quantized inside the op: there is no stored FP8 form to concatenate
  if kind is not quant.QWeight and any(jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16) for w in ws):
    return False
  return _on_kernels(ws[0], lcfg)


def _on_kernels(w, lcfg: ops.LinearConfig) -> bool:
  """Whether ``ops.linear`` runs this weight on the Hopper kernels (the tests stand in for a GPU here)."""
  return ops.linear_backend(w, lcfg.backend) == "pallas"


def _concat(ws):
  if isinstance(ws[0], quant.QWeight):
    return quant.QWeight(jnp.concatenate([w.q for w in ws]), jnp.concatenate([w.scale for w in ws]))
  return jnp.concatenate(ws)


def _bias_names(names) -> tuple:
  """The bias keys of a group's weights (Qwen2's bq/bk/bv for wq/wk/wv; None for a weight that has no bias row)."""
  return tuple(BIAS_OF.get(n) for n in names)


def _fused_bias_key(names) -> str | None:
  """The key of a group's concatenated biases ("bq+bk+bv") where every weight of the group has a bias row."""
  biases = _bias_names(names)
  return None if None in biases else fused_key(biases)


def _groups_to_fuse(layer: dict, lcfg: ops.LinearConfig):
  return [names for names in GROUPS if all(n in layer for n in names) and fusable([layer[n] for n in names], lcfg)]


def needs_fusing(params, lcfg: ops.LinearConfig) -> bool:
  """Whether ``fuse_layers`` would change ``params`` (checked on types and shapes only: no device work)."""
  return any(_groups_to_fuse(p, lcfg) for p in params["layers"])


def fuse_layers(params, lcfg: ops.LinearConfig):
  """``params`` with each layer's fusable groups replaced by their fused key (weights concatenated along N, in the
  group's order); the rest as it is. Idempotent. Call it under ``jax.jit`` (the sampler does): the concatenation
  is a copy of the group's weights."""
  layers = []
  for p in params["layers"]:
    groups = _groups_to_fuse(p, lcfg)
    if groups:
      p = dict(p)
      for names in groups:
        p[fused_key(names)] = _concat([p.pop(n) for n in names])
        biases = _bias_names(names)
        if _fused_bias_key(names) and all(b in p for b in biases):  # Qwen2: q/k/v biases alike ("bq+bk+bv")
          p[_fused_bias_key(names)] = jnp.concatenate([p.pop(b) for b in biases])
    layers.append(p)
  return {**params, "layers": type(params["layers"])(layers)}


def project(p, x, names, sizes, lcfg: ops.LinearConfig):
  """[x . w^T (+ its bias) for w in the group ``names``], of output widths ``sizes`` (None: equal widths): one GEMM
  split by columns where the layer holds the fused weight, else one ``ops.linear`` per weight. A weight's bias
  (``schema.BIAS_OF``, where the layer has it) is added to the GEMM's FP32 output inside ``ops.linear``, which is
  elementwise per column: the fused form's columns stay the separate GEMMs'."""
  key, biases = fused_key(names), _bias_names(names)
  if key not in p:
    return [ops.linear(x, p[n], lcfg, PARALLEL[n], bias=p.get(b)) for n, b in zip(names, biases)]
  w = p[key]
  n = w.shape[0]
  sizes = (n // len(names),) * len(names) if sizes is None else tuple(sizes)
  if n != sum(sizes):
    raise ValueError(f"fused weight {key!r} has {n} output rows, the model expects {sizes} (sum {sum(sizes)}): "
                     "params fused for another model config?")
  bias_key = _fused_bias_key(names)
  if any(b in p for b in biases if b):
    raise ValueError(f"layer holds the fused weight {key!r} but its biases {biases} apart: fuse them with "
                     f"fuse_layers, which concatenates both")
  y = ops.linear(x, w, lcfg, PARALLEL[names[0]], bias=p.get(bias_key) if bias_key else None)
  return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
