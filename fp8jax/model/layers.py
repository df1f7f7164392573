"""Shared pieces of the decoder blocks: RMSNorm and rotary position embeddings (HF conventions)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp8jax import backends, sharding
from fp8jax.model.config import ModelConfig
from pallas_kernels import core
from pallas_kernels import rms_norm as norm_ref


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def embed(table, tokens, dtype, mesh=None):
  """The rows of ``table`` for ``tokens`` in ``dtype`` (the table cast first, as before: the same values and, on a
  sharded table, the same communication). Its gradient sums each position's cotangent into its token's row in the
  table's dtype (the FP32 master; as the transpose of the BF16 gather it summed in BF16, where a token repeated a
  few thousand times lost most of its later contributions to rounding), in a fixed order (``core.segment_sum``:
  XLA:GPU's scatter-add uses atomics, so the gradient, and every run's weights after it, changed from run to run).
  ``mesh``: on a mesh that splits the batch, each device sums its own tokens and the partial tables are all-reduced."""
  return table.astype(dtype)[tokens]


def _embed_fwd(table, tokens, dtype, mesh):
  # (V, 0): a zero-byte array that carries the table's row count and dtype into the backward pass
  return embed(table, tokens, dtype, mesh), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _embed_bwd(dtype, mesh, res, g):
  tokens, tag = res
  v, d = tag.shape[0], g.shape[-1]

  def local(tok, g_):
    return core.segment_sum(tok.reshape(-1), g_.reshape(-1, d), v, tag.dtype)

  axes = sharding.split_batch_axes(mesh, tokens.shape[0])
  if axes is None:
    return local(tokens, g), None
  P = jax.sharding.PartitionSpec
  spec = P(axes, *([None] * (tokens.ndim - 1)))
  run = sharding.per_device(lambda tok, g_: jax.lax.psum(local(tok, g_), axes), mesh,
                            (spec, P(*spec, None)), P())
  return run(tokens, g), None


embed.defvjp(_embed_fwd, _embed_bwd)


def rms_norm(x, w, eps, backend: str = "auto", mesh=None):
  """HF LlamaRMSNorm: normalize in FP32, cast back, then scale (``pallas_kernels.rms_norm.rms_rows``, with its
  overflow-safe prescale of huge rows).

  On a CUDA GPU ("auto" / "pallas", config key model.norm_backend) the rows go through the fixed-tile Pallas kernel,
  so that a row's bits do not depend on the number of rows (the sampler's decode rows are the trainer's); its
  backward is the reference's. Elsewhere, or for widths the kernel does not take (logged, ``backends.backend_report``),
  the reference (on CPU with a fixed-order sum, ``rms_norm_invariant``: batch invariant there too). ``mesh``: on a
  multi-device mesh the kernel runs per device (``_per_device``)."""
  if _norm_backend(backend, x) == "pallas":
    return _per_device(lambda x_, w_: _rms_norm_kernel(x_, w_, eps), mesh, x)(x, w)
  return norm_ref.rms_norm_invariant(x, w, eps)


def add_rms_norm(x, h, w, eps, backend: str = "auto", mesh=None):
  """(x + h, rms_norm(x + h)): the residual add before a pre-norm (the add ``pallas_kernels.rms_norm.residual_add``,
  x + h in x's dtype). ``h`` None: (x, rms_norm(x)). Where ``rms_norm`` runs its kernel the add runs inside it
  (``pallas_kernels.rms_norm.add_rms_norm``: one launch, the norm's rows bitwise ``rms_norm`` of the sum), with the
  reference's gradient; elsewhere the reference add, then ``rms_norm``. Either way the same bits."""
  if h is None:
    return x, rms_norm(x, w, eps, backend, mesh)
  if _norm_backend(backend, x) == "pallas":
    return _per_device(lambda x_, h_, w_: _add_rms_norm_kernel(x_, h_, w_, eps), mesh, x, rows=2, outs=2)(x, h, w)
  s = norm_ref.residual_add(x, h)
  return s, norm_ref.rms_norm_invariant(s, w, eps)


def _per_device(fn, mesh, x, rows: int = 1, outs: int = 1):
  """``fn(*row_arrays, w)`` per device (``sharding.per_device``), else as is: the kernel is an opaque custom call,
  which XLA would run on gathered rows. Rows are independent, so each device normalizes its own: dim 0 over the
  batch axes that divide it and, for a (B, T, H, D) input (QK-norm), the heads over a "tensor" axis that divides
  them (the tensor-parallel layout of q and k). ``rows`` / ``outs``: how many row-shaped inputs / outputs."""
  axes = sharding.split_batch_axes(mesh, x.shape[0])
  tp = sharding.tensor_axis(mesh) if x.ndim == 4 else None
  if tp is not None and x.shape[2] % mesh.shape[tp]:
    tp = None
  if axes is None and tp is None:
    return fn
  P = jax.sharding.PartitionSpec
  spec = P(axes, *([None] * (x.ndim - 2)), None) if tp is None else P(axes, None, tp, None)
  return sharding.per_device(fn, mesh, (spec,) * rows + (P(),), spec if outs == 1 else (spec,) * outs)


@functools.cache
def _norm_kernel():
  from pallas_kernels import rms_norm as kernel  # noqa: PLC0415 (imports the Pallas Triton backend only when asked for)
  return kernel


def _norm_backend(requested: str, x) -> str:
  def probe():
    if not backends.gpu_available():
      return False, "no CUDA GPU"
    why = norm_ref.unsupported(x)
    return (True, "CUDA GPU") if why is None else (False, f"fallback to the reference: {why}")

  return backends.choose_backend(requested, what="rms_norm", config_key="model.norm_backend", probe=probe,
                                 prefix="norm:")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_kernel(x, w, eps):
  return _norm_kernel().rms_norm(x, w, eps)


def _rms_norm_kernel_fwd(x, w, eps):
  return _rms_norm_kernel(x, w, eps), (x, w)


def _rms_norm_kernel_bwd(eps, res, g):
  x, w = res
  return jax.vjp(lambda x_, w_: norm_ref.rms_norm_reference(x_, w_, eps), x, w)[1](g)


_rms_norm_kernel.defvjp(_rms_norm_kernel_fwd, _rms_norm_kernel_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _add_rms_norm_kernel(x, h, w, eps):
  return tuple(_norm_kernel().add_rms_norm(x, h, w, eps))


def _add_rms_norm_kernel_fwd(x, h, w, eps):
  return _add_rms_norm_kernel(x, h, w, eps), (x, h, w)


def _add_rms_norm_kernel_bwd(eps, res, g):
  x, h, w = res
  return jax.vjp(lambda x_, h_, w_: norm_ref.add_rms_norm_reference(x_, h_, w_, eps), x, h, w)[1](tuple(g))


_add_rms_norm_kernel.defvjp(_add_rms_norm_kernel_fwd, _add_rms_norm_kernel_bwd)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """RoPE inverse frequencies over ``cfg.rope_dim``, with Llama-3 scaling (HF rope_type "llama3") when
  cfg.rope_scaling is set, or YaRN (HF rope_type "yarn") when cfg.rope_yarn is."""
  hd = cfg.rope_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  if cfg.rope_yarn is not None:
    return _yarn_inv_freq(inv, hd, cfg.rope_theta, cfg.rope_yarn)
  if cfg.rope_scaling is None:
    return inv
  factor, low, high, old_ctx = cfg.rope_scaling
  wavelen = 2 * math.pi / inv
  low_wl, high_wl = old_ctx / low, old_ctx / high
  scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
  smooth = (old_ctx / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_wl) & (wavelen <= low_wl)
  return jnp.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv, dim: int, theta: float, yarn) -> jax.Array:
  """YaRN (Peng et al. 2023, sec. 3.2 "NTK-by-parts"), as transformers' ``_compute_yarn_parameters`` defines it:
  frequencies rotating fewer than ``beta_slow`` times over the original context are interpolated (divided by
  ``factor``), more than ``beta_fast`` times kept, a linear ramp between (over the truncated correction range)."""
  factor, old_ctx, beta_fast, beta_slow = yarn[:4]

  def correction_dim(rotations):  # the dim index whose wavelength fits ``rotations`` times into old_ctx
    return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(correction_dim(beta_fast)), 0)
  high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
  high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
  return (inv / factor) * (1 - keep) + inv * keep


def yarn_mscale(scale: float, mscale: float) -> float:
  """YaRN's attention temperature term 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1; DeepSeek-V2 sec. 2.1.3)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
  """The factor transformers multiplies cos and sin by (its YaRN ``attention_factor``): with both ``mscale`` and
  ``mscale_all_dim`` set, mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for DeepSeek-V3, where they
  are equal), else mscale(factor, 1); 1 without YaRN."""
  if cfg.rope_yarn is None:
    return 1.0
  factor, _, _, _, mscale, mscale_all_dim = cfg.rope_yarn
  if mscale and mscale_all_dim:
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  return yarn_mscale(factor, 1.0)


def apply_rope(x_BxTxHxD, positions_BxT, inv_freq, *, interleaved: bool = False, scale: float = 1.0):
  """Rotate-half RoPE (the HF convention: first and second halves of head_dim form the pairs).

  ``interleaved`` (DeepSeek, transformers' ``apply_rotary_pos_emb_interleave``): the pairs are adjacent dims
  (2i, 2i+1); they are gathered into halves first ([even dims, odd dims]) and rotated as above, so the output is in
  the rotate-half layout, as transformers' is. q and k get the same permutation, so their dot is unchanged.
  ``scale``: multiplies cos and sin before their cast (YaRN's attention factor, ``rope_attention_factor``)."""
  if interleaved:
    x_BxTxHxD = jnp.concatenate([x_BxTxHxD[..., 0::2], x_BxTxHxD[..., 1::2]], axis=-1)
  ang = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # (B, T, hd/2)
  emb = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  if scale != 1.0:
    cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
  cos, sin = cos.astype(x_BxTxHxD.dtype), sin.astype(x_BxTxHxD.dtype)
  x1, x2 = jnp.split(x_BxTxHxD, 2, axis=-1)
  return x_BxTxHxD * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
