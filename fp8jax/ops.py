"""FP8 linear layer with a custom VJP, and the GEMM backend switch.

``linear(x, w, cfg)`` is the one call every linear layer of fp8jax makes. What it computes depends only on the
type of ``w`` (chosen by the recipe in ``fp8jax.quant``), never on who calls it:

* plain array ``w_NxK``            -> BF16 mode: ``x . w^T`` with BF16 operands and FP32 accumulation (the lm_head,
                                      and every linear of the BF16 recipe); dgrad dy . w and wgrad dy^T . x likewise,
                                      with dy in BF16 (dx, dw rounded to BF16 as autodiff of the BF16 casts does).
* ``FP8Weight(w_NxK)`` (training)  -> forward  Q(x)[1x128] . Q(w)[128x128]
                                      dgrad    Q(dy)[1x128] . Q(w)^T          (dx in x's dtype)
                                      wgrad    Q(dy^T)[1x128 over tokens] . Q(x^T)[1x128 over tokens]
                                      (dw in FP32, the master weights' dtype; it flows to ``w``)
* ``QWeight(q, scale)`` (sampling) -> the same forward on weights quantized beforehand by ``quantize_params``.
  ``quantize_weight`` is deterministic, so the FP8Weight and QWeight forwards are bitwise the same computation.
* ``lora.LoRAWeight(base, a, b)``  -> LoRA: the frozen base in its own mode (QWeight or BF16) plus the low-rank
                                      adapters in BF16 mode (``fp8jax.lora.lora_linear`` defines the roundings).

``grouped_linear(x, w, group_sizes, cfg)`` is the mixture-of-experts form (rows sorted by group, w stacked (E, N, K),
same three modes); each group's results are bitwise ``linear`` on its rows alone. ``grouped_linear_tiles`` is the
same op on rows already in the grouped GEMM's tile layout (the MoE block keeps them there). On "pallas" the forward
and dgrad run the grouped Hopper kernel (``fp8_gemm_mgpu.grouped_fp8_gemm_tiles``, in BF16 mode
``grouped_bf16_gemm_tiles``), the wgrads the grouped wgrad kernels (``grouped_fp8_wgrad_tiles``,
``grouped_bf16_wgrad_tiles``: each expert's dW contracted over its own token tiles only). The references ("xla")
loop over tile positions (a batched step for all experts) or over tiles, whichever the group sizes make cheaper
(``grouped_gemm.sum_by_tile``).

Outputs are ``cfg.out_dtype`` (BF16 by default). The GEMMs run on a backend: "xla" is the exact block-math
reference in ``pallas_kernels.fp8_gemm`` (every kernel is tested against it); "pallas" is the Hopper kernel, with
the activations quantized by the one-pass kernels of ``pallas_kernels.fp8_quant`` (bitwise the quantizer's output).
"auto" picks the kernel on sm_90 GPUs and the reference elsewhere; the choice is logged once and readable through
``backend_report()``, so a change of numerics is never silent. BF16 mode follows the same setting (fp8.gemm_backend):
"pallas" is the batch-invariant BF16 mode of the same Hopper kernel (``fp8_gemm_mgpu.bf16_gemm``; cuBLAS, which a
plain ``jnp.dot`` runs on a GPU, picks its kernels by M, so a row's logits would depend on the batch), "xla" is
``core.invariant_dot`` (batch invariant on XLA:CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp

from fp8jax import backends, quant, sharding
from fp8jax import recipes
from pallas_kernels import core
from pallas_kernels import fp8_gemm as fp8_gemm_ref
from pallas_kernels import grouped_gemm as grouped_ref

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LinearConfig:
  """Static settings of ``linear`` (hashable: it is a nondiff argument of the custom VJP)."""

  pow2_scales: bool = False
  backend: str = "auto"
  out_dtype: str = "bfloat16"
  # The device mesh the caller's arrays live on (the trainer sets it). With the "pallas" backend on more than one
  # device, the kernels then run per device on their blocks (``_placement``) instead of on gathered operands.
  mesh: jax.sharding.Mesh | None = None
  # Tensor parallelism of this linear over the mesh's "tensor" axis: "column" (output features split: wq, wk, wv,
  # w_gate, w_up), "row" (input features split, partial products summed: wo, w_down) or None (gathered). Set per
  # call by ``linear(..., parallel=)`` from the parameter schema (``schema.PARALLEL``).
  parallel: str | None = None

  @classmethod
  def from_recipe(cls, recipe: recipes.Recipe, out_dtype: str = "bfloat16",
                  mesh: jax.sharding.Mesh | None = None) -> "LinearConfig":
    return cls(pow2_scales=recipe.pow2_scales, backend=recipe.gemm_backend, out_dtype=out_dtype, mesh=mesh)


# ------------------------------------------------------------------------------------------------------------------
# Backend switch
# ------------------------------------------------------------------------------------------------------------------

@functools.cache
def _pallas_gemm():
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415 (imports Mosaic GPU only when asked for)
  return fp8_gemm_mgpu.fp8_gemm


@functools.cache
def _pallas_quant():
  from pallas_kernels import fp8_quant  # noqa: PLC0415 (imports the Pallas Triton backend only when asked for)
  return fp8_quant


@functools.cache
def _pallas_grouped_gemm():
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415 (imports Mosaic GPU only when asked for)
  return fp8_gemm_mgpu.grouped_fp8_gemm_tiles


@functools.cache
def _pallas_bf16_gemm():
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415 (imports Mosaic GPU only when asked for)
  return fp8_gemm_mgpu.bf16_gemm


def _pallas_grouped_bf16_gemm():
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415 (imports Mosaic GPU only when asked for)
  return fp8_gemm_mgpu.grouped_bf16_gemm_tiles


def _pallas_grouped_wgrad():
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415 (imports Mosaic GPU only when asked for)
  return fp8_gemm_mgpu.grouped_fp8_wgrad_tiles


def _pallas_grouped_bf16_wgrad():
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415 (imports Mosaic GPU only when asked for)
  return fp8_gemm_mgpu.grouped_bf16_wgrad_tiles


def _kernel_probe(*loaders):
  if not backends.hopper_available():
    return False, "no sm_90 GPU"
  try:
    for load in loaders:
      load()
  except ImportError as e:  # kernel module missing or broken: say so, never silently
    return False, f"pallas kernel unavailable ({e})"
  return True, "sm_90 GPU"


def resolve_backend(requested: str) -> str:
  """'auto' | 'xla' | 'pallas' -> the GEMM backend that will run; logs the choice once per (request, result)."""
  return backends.choose_backend(requested, what="fp8 gemm", config_key="fp8.gemm_backend",
                        probe=lambda: _kernel_probe(_pallas_gemm, _pallas_quant))


def resolve_bf16_backend(requested: str) -> str:
  """``resolve_backend`` for the BF16-mode GEMMs (the same setting; listed as ``bf16:requested->chosen``)."""
  return backends.choose_backend(requested, what="bf16 gemm", config_key="fp8.gemm_backend",
                        probe=lambda: _kernel_probe(_pallas_bf16_gemm), prefix="bf16:")


def linear_backend(w, requested: str) -> str:
  """The backend ``linear`` runs weight ``w`` on: the FP8 GEMM's for an FP8 weight (``QWeight`` / ``FP8Weight``),
  the BF16 GEMM's otherwise."""
  if isinstance(w, _lora().LoRAWeight):  # the base's GEMM (the low-rank GEMMs are BF16 mode)
    w = w.base
  if isinstance(w, (quant.QWeight, quant.FP8Weight)):
    return resolve_backend(requested)
  return resolve_bf16_backend(requested)


def _pad_n(b_q, b_s):
  """B (N, K) with N zero-padded to a multiple of 128 for the Hopper kernel, which takes whole 128-row tiles (a
  ragged width: SmolLM2's 576). Output columns are independent, so the first N are bitwise the unpadded product's;
  tile scales (Nb, Kb) already cover the partial tile, per-row scales (N, Kb: wgrad) get zero rows."""
  n = b_q.shape[0]
  if n % quant.BLOCK == 0:
    return b_q, b_s
  return quant.pad_k(b_q, 0), (quant.pad_k(b_s, 0) if b_s.shape[0] == n else b_s)


def fp8_gemm(a_q, a_s, b_q, b_s, out_dtype, backend: str = "auto") -> jax.Array:
  """C = A . B^T on the resolved backend (see ``pallas_kernels.fp8_gemm`` for operand layouts)."""
  if resolve_backend(backend) == "pallas":
    n, (b_q, b_s) = b_q.shape[0], _pad_n(b_q, b_s)
    out = _pallas_gemm()(a_q, a_s, b_q, b_s, out_dtype=out_dtype)
    return out[:, :n] if out.shape[1] != n else out
  return fp8_gemm_ref.fp8_gemm_reference(a_q, a_s, b_q, b_s, out_dtype=out_dtype)


def quantize_act(x, pow2: bool = False, backend: str = "auto"):
  """``quant.quantize_act`` on the resolved backend: the one-pass Pallas kernel on sm_90 (same bits), XLA else."""
  if resolve_backend(backend) == "pallas":
    return _pallas_quant().quantize_act(x, pow2)
  return quant.quantize_act(x, pow2)


def quantize_act_t(x_MxK, pow2: bool = False, backend: str = "auto"):
  """``quant.quantize_act_t`` (wgrad layout) on the resolved backend, like ``quantize_act``."""
  if resolve_backend(backend) == "pallas":
    return _pallas_quant().quantize_act_t(x_MxK, pow2)
  return quant.quantize_act_t(x_MxK, pow2)


# ------------------------------------------------------------------------------------------------------------------
# Per-device execution of the kernels on a mesh
# ------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Placement:
  """Where one linear's GEMMs run on a mesh: rows over ``rows`` (batch axes, or None: every device has all rows),
  features over ``tp`` ("tensor", or None) in the linear's ``parallel`` style."""

  mesh: jax.sharding.Mesh
  rows: tuple[str, ...] | None
  tp: str | None
  parallel: str | None


def _placement(cfg: LinearConfig, m: int, n: int, k: int, backend: str | None = None) -> _Placement | None:
  """How the kernels of an (m, k) x (n, k) linear run per device, or None (one device, or the "xla" backend).

  Pallas kernels are opaque custom calls to XLA's SPMD partitioner: inside a sharded ``jit`` their operands are
  gathered and every device computes the whole product. So with the "pallas" backend on a multi-device mesh the
  GEMMs run under ``shard_map`` (``sharding.per_device``):
  * rows over the batch axes when they divide m (each device its tokens; the FP8 weight gathered over fsdp, as FSDP
    does anyway): bitwise the single-device rows, since rows are independent and the kernels batch invariant;
  * with ``cfg.parallel`` and a "tensor" axis, Megatron tensor parallelism with shards of whole 128-blocks: column
    parallel splits N (n a multiple of 128 x tensor), row parallel splits K (k likewise), so every device's
    activation groups (1x128) and weight tiles (128x128) are exactly the unsharded ones. Where a contraction is split
    (row-parallel forward, column-parallel dgrad) the FP32 partial products are summed in rank order
    (``sharding.ordered_sum``); this choice does not depend on m, so decode rows (m = slots) and training rows take
    the same path and stay bitwise equal. A dimension that is not aligned falls back to gathered weights (logged).
  wgrad contracts over tokens: per-device partial dW, summed (``psum``) over the row axes, like any data-parallel
  gradient. ``backend`` is the caller's resolved backend (default: the FP8 GEMMs').
  """
  if not sharding.multi_device(cfg.mesh) or (backend or resolve_backend(cfg.backend)) != "pallas":
    return None
  rows = sharding.split_batch_axes(cfg.mesh, m)
  tp = sharding.tensor_axis(cfg.mesh) if cfg.parallel else None
  if tp is not None:
    split = {"column": n, "row": k}[cfg.parallel]
    if split % (quant.BLOCK * cfg.mesh.shape[tp]):
      _note_once(f"tp:{cfg.parallel}:{n}x{k}", f"fp8jax: {cfg.parallel}-parallel linear {n}x{k}: "
                 f"{'N' if cfg.parallel == 'column' else 'K'} = {split} is not a multiple of 128 x tensor "
                 f"({cfg.mesh.shape[tp]}); its weight is gathered over the tensor axis instead")
      tp = None
  if rows is None and tp is None:
    return None
  return _Placement(cfg.mesh, rows, tp, cfg.parallel if tp else None)


_NOTED: set[str] = set()


def _note_once(key: str, msg: str):
  if key not in _NOTED:
    _NOTED.add(key)
    log.warning(msg)


def _sharded(local, role: str, pl: _Placement | None, out_dtype):
  """``local(out_dtype, a, b...)`` of one GEMM role run per device as ``pl`` says, or as is (``pl`` None).

  Roles (operands of ``linear``'s three GEMMs; w stands for the weight's arrays, ``q`` and ``scale`` or the BF16
  weight, all split alike):
    "fwd"   (x (M, K), *w)  -> y (M, N)
    "dgrad" (dy (M, N), *w) -> dx (M, K)
    "wgrad" (dy (M, N), x (M, K)) -> dw (N, K), summed over the row axes
  ``local`` is called with FP32 where partial products are summed over the tensor axis (the cast to ``out_dtype``
  follows the sum), else with ``out_dtype``."""
  if pl is None:
    return functools.partial(local, out_dtype)
  P = jax.sharding.PartitionSpec
  R, T = pl.rows, pl.tp
  col, row = pl.parallel == "column", pl.parallel == "row"
  w = P(T, None) if col else P(None, T) if row else P()
  if role == "fwd":
    specs, out, sum_tp = (P(R, T if row else None), w), P(R, T if col else None), row
  elif role == "dgrad":
    specs, out, sum_tp = (P(R, T if col else None), w), P(R, T if row else None), col
  else:
    specs, out, sum_tp = (P(R, T if col else None), P(R, T if row else None)), w, False

  def body(*a):
    y = local(jnp.float32 if sum_tp else out_dtype, *a)
    if role == "wgrad" and R:
      y = jax.lax.psum(y, R)
    if sum_tp:
      y = sharding.ordered_sum(y, T).astype(out_dtype)
    return y

  def run(*a):
    n_w = len(a) - 1
    return sharding.per_device(body, pl.mesh, (specs[0],) + (specs[1],) * n_w, out)(*a)
  return run


# ------------------------------------------------------------------------------------------------------------------
# The linear op
# ------------------------------------------------------------------------------------------------------------------


def _act_gemm(x_MxK, b_q, b_s, out_dtype, cfg: LinearConfig, b_scales_kernel=None):
  """Q(x)[1x128] . B^T (B's tile scales ``b_s``) on the resolved backend. On "pallas" the quantizer kernel writes
  x's scales in the layout the GEMM kernel reads, and ``b_scales_kernel`` (``QWeight.kernel_scale``) spares the
  GEMM's wrapper its layout op: the same values, so the same bits as ``quantize_act`` then ``fp8_gemm``."""
  if resolve_backend(cfg.backend) == "pallas":
    xq, xs_KbxM = _pallas_quant().quantize_act(x_MxK, cfg.pow2_scales, scales_t=True)
    n, (b_q, b_s) = b_q.shape[0], _pad_n(b_q, b_s)
    out = _pallas_gemm()(xq, xs_KbxM, b_q, b_s, out_dtype=out_dtype, a_scales_t=True,
                         b_scales_kernel=b_scales_kernel)
    return out[:, :n] if out.shape[1] != n else out
  xq, xs = quant.quantize_act(x_MxK, cfg.pow2_scales)
  return fp8_gemm_ref.fp8_gemm_reference(xq, xs, b_q, b_s, out_dtype=out_dtype)


def with_kernel_scales(params, cfg: LinearConfig):
  """``params`` with every 2-D ``QWeight``'s tile scales also laid out for the Hopper GEMM kernel
  (``QWeight.kernel_scale``), for a loop that runs the same weights many times: the sampler's decode makes them
  once per call instead of once per GEMM and step (XLA does not hoist that layout op, a 32x broadcast, out of a
  while loop: ~130 launches per decode step at Llama-3.1-8B). As they are off the kernels and on a multi-device
  mesh (the kernels then run per device on split weights). The same values: no bit changes."""
  if resolve_backend(cfg.backend) != "pallas" or sharding.multi_device(cfg.mesh):
    return params
  from pallas_kernels import fp8_gemm_mgpu  # noqa: PLC0415 (imports Mosaic GPU only where it runs)

  def lay_out(w):
    if isinstance(w, quant.QWeight) and w.q.ndim == 2 and w.kernel_scale is None:
      return dataclasses.replace(w, kernel_scale=fp8_gemm_mgpu.kernel_b_scales(w.scale))
    return w
  return jax.tree.map(lay_out, params, is_leaf=quant.is_fp8_leaf)


def _forward_q(x_MxK, qw: quant.QWeight, cfg: LinearConfig):
  pl = _placement(cfg, x_MxK.shape[0], qw.q.shape[0], x_MxK.shape[1])
  kernel_scale = qw.kernel_scale if pl is None else None  # per device, the weights are split: laid out per call

  def local(out_dtype, x, q, scale):
    return _act_gemm(quant.pad_k(x), quant.pad_k(q, -1), scale, jnp.dtype(out_dtype), cfg, kernel_scale)
  return _sharded(local, "fwd", pl, cfg.out_dtype)(x_MxK, qw.q, qw.scale)


def _dgrad(dy_MxN, qw: quant.QWeight, k: int, dtype, cfg: LinearConfig):
  """dx = Q(dy)[1x128 over N] . Q(w)^T: B is w^T stored (K, N), i.e. K-major over N."""
  def local(out_dtype, dy, q, scale):
    wt_KxN = quant.pad_k(quant.pad_k(q.T, -1), 0)  # transposing 128x128 tiles keeps them 128x128 tiles
    return _act_gemm(quant.pad_k(dy), wt_KxN, scale.T, jnp.dtype(out_dtype), cfg)[:, :q.shape[1]]
  pl = _placement(cfg, dy_MxN.shape[0], dy_MxN.shape[1], k)
  return _sharded(local, "dgrad", pl, dtype)(dy_MxN, qw.q, qw.scale)


def _wgrad(dy_MxN, x_MxK, cfg: LinearConfig):
  """dw = Q(dy^T)[1x128 over tokens] . Q(x^T)[1x128 over tokens] -> (N, K) in FP32."""
  def local(out_dtype, dy, x):
    aq, as_ = quantize_act_t(dy, cfg.pow2_scales, cfg.backend)
    bq, bs = quantize_act_t(x, cfg.pow2_scales, cfg.backend)
    return fp8_gemm(aq, as_, bq, bs, out_dtype, cfg.backend)
  pl = _placement(cfg, dy_MxN.shape[0], dy_MxN.shape[1], x_MxK.shape[1])
  return _sharded(local, "wgrad", pl, jnp.float32)(dy_MxN, x_MxK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear_fp8_master(x_MxK, w_NxK, cfg: LinearConfig):
  return _forward_q(x_MxK, quant.quantize_weight(w_NxK, cfg.pow2_scales), cfg)


def _master_fwd(x_MxK, w_NxK, cfg):
  qw = quant.quantize_weight(w_NxK, cfg.pow2_scales)
  return _forward_q(x_MxK, qw, cfg), (x_MxK, qw, jnp.zeros((), w_NxK.dtype))


def _master_bwd(cfg, res, dy_MxN):
  x_MxK, qw, w_dtype_tag = res
  dx = _dgrad(dy_MxN, qw, x_MxK.shape[1], x_MxK.dtype, cfg)
  dw = _wgrad(dy_MxN, x_MxK, cfg)
  return dx, dw.astype(w_dtype_tag.dtype)


_linear_fp8_master.defvjp(_master_fwd, _master_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear_fp8_frozen(x_MxK, qw: quant.QWeight, cfg: LinearConfig):
  return _forward_q(x_MxK, qw, cfg)


def _frozen_fwd(x_MxK, qw, cfg):
  # A (0, K) array of x's dtype carries K and the dtype into the backward pass at no cost.
  return _forward_q(x_MxK, qw, cfg), (qw, jnp.zeros((0, x_MxK.shape[1]), x_MxK.dtype))


def _frozen_bwd(cfg, res, dy_MxN):
  qw, x_tag = res
  return _dgrad(dy_MxN, qw, x_tag.shape[1], x_tag.dtype, cfg), jax.tree.map(jnp.zeros_like, qw)


_linear_fp8_frozen.defvjp(_frozen_fwd, _frozen_bwd)


def _bf16_gemm(a_MxK, b_NxK, out_dtype):
  """The BF16 Hopper kernel on any (M, K) x (N, K) BF16 operands -> (M, N) ``out_dtype``.

  N and K are zero-padded to multiples of 128, as the kernel needs: zeros add exact zeros, and the padding depends
  only on N and K, never on M, so every row still sees the same computation whatever the batch (M is padded inside
  the kernel's wrapper)."""
  n = b_NxK.shape[0]
  out = _pallas_bf16_gemm()(quant.pad_k(a_MxK), quant.pad_k(quant.pad_k(b_NxK), 0), out_dtype=jnp.dtype(out_dtype))
  return out[:, :n] if out.shape[1] != n else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear_bf16_kernel(x_MxK, w_NxK, cfg: LinearConfig):
  return _bf16_fwd(x_MxK, w_NxK, cfg)[0]


def _bf16_fwd(x_MxK, w_NxK, cfg):
  xb, wb = x_MxK.astype(jnp.bfloat16), w_NxK.astype(jnp.bfloat16)
  pl = _placement(cfg, *xb.shape[:1], *wb.shape, backend="pallas")
  y = _sharded(lambda od, x, w: _bf16_gemm(x, w, od), "fwd", pl, cfg.out_dtype)(xb, wb)
  # Zero-size tags carry x's and w's dtypes (the cotangents' dtypes) at no cost.
  return y, (xb, wb, jnp.zeros((0,), x_MxK.dtype), jnp.zeros((0,), w_NxK.dtype))


def _bf16_bwd(cfg, res, dy_MxN):
  """dx = dy . w and dw = dy^T . x on the kernel, with the XLA path's roundings: its autodiff computes both from the
  FP32 cotangent and rounds them to BF16 (the cotangents of the BF16 casts). The tensor cores take dy in BF16: exact
  for BF16 outputs, one rounding (2^-9 relative) of the lm_head's FP32 dlogits."""
  xb, wb, x_tag, w_tag = res
  pl = _placement(cfg, *xb.shape[:1], *wb.shape, backend="pallas")
  dyb = dy_MxN.astype(jnp.bfloat16)
  dgrad = lambda od, dy, w: _bf16_gemm(dy, w.T, od)  # B = w^T stored (K, N): K-major over N
  dx = _sharded(dgrad, "dgrad", pl, jnp.bfloat16)(dyb, wb)
  # wgrad contracts over tokens (M, zero-padded to a multiple of 128 by _bf16_gemm). FP32 out: a mesh sums the
  # per-device partials in FP32, and the one rounding to BF16 comes after, as on one device.
  wgrad = lambda od, dy, x: _bf16_gemm(dy.T, x.T, od)
  dw = _sharded(wgrad, "wgrad", pl, jnp.float32)(dyb, xb)
  return dx.astype(x_tag.dtype), dw.astype(jnp.bfloat16).astype(w_tag.dtype)


_linear_bf16_kernel.defvjp(_bf16_fwd, _bf16_bwd)


def _linear_bf16(x_MxK, w_NxK, cfg: LinearConfig):
  """BF16 mode on the resolved backend: the Hopper kernel (custom VJP above) or ``invariant_dot`` (autodiff)."""
  if resolve_bf16_backend(cfg.backend) == "pallas":
    return _linear_bf16_kernel(x_MxK, w_NxK, cfg)
  return core.invariant_dot(x_MxK.astype(jnp.bfloat16), w_NxK.astype(jnp.bfloat16)).astype(cfg.out_dtype)


def _refuse_complex(op: str, x, w):
  w_dtypes = [a.dtype for a in jax.tree.leaves(w)]
  if jnp.iscomplexobj(x) or any(jnp.issubdtype(d, jnp.complexfloating) for d in w_dtypes):
    raise TypeError(f"{op}: complex operands are not supported (x {x.dtype}, weight {w_dtypes}); the FP8/BF16 "
                    f"casts would silently drop the imaginary part")


PARALLEL_STYLES = (None, "column", "row")


def _lora():
  from fp8jax import lora  # noqa: PLC0415 (lora's op is built of linear calls: imported here, not at the top)
  return lora


def linear(x: jax.Array, w, cfg: LinearConfig = LinearConfig(), parallel: str | None = None, *,
           bias: jax.Array | None = None) -> jax.Array:
  """``x_...xK . w^T (+ bias)`` for ``w`` stored (N, K); FP8 or BF16 by the type of ``w`` (module docstring).

  ``bias`` (N,) (Qwen2's q/k/v projections): the GEMM then writes its FP32 accumulator, the bias is added to it
  in FP32 and the sum rounded once to ``cfg.out_dtype``. The bias is first rounded to BF16, as BF16-mode weights
  are, so that the trainer's FP32 master and the sampler's BF16 copy add the same values (one engine). Without a
  bias the op is as before, bit for bit.

  ``parallel``: the layer's tensor-parallel style on a mesh with a "tensor" axis ("column" | "row", the parameter
  schema's ``PARALLEL``; ``_placement`` says what each does), or None. It changes where the kernels run, and for
  "row" the order of the K sum (over shards, then summed in rank order), never the result's shape.
  ``x`` with no rows (M = 0) gives the empty (..., N) result. Complex operands are refused (the casts to BF16/FP8
  would drop the imaginary part silently).
  """
  if parallel not in PARALLEL_STYLES:
    raise ValueError(f"linear: parallel must be one of {PARALLEL_STYLES}, got {parallel!r}")
  if parallel != cfg.parallel:
    cfg = dataclasses.replace(cfg, parallel=parallel)
  if x.ndim < 1:
    raise ValueError(f"linear: x must have a contraction axis (shape (..., K)), got shape {tuple(x.shape)}")
  if len(w.shape) != 2:
    raise ValueError(f"linear: weight must be 2-D, stored (N, K) = (out, in), got shape {tuple(w.shape)}")
  _refuse_complex("linear", x, w)
  *lead, k = x.shape
  n = w.shape[0]
  if w.shape[-1] != k:
    raise ValueError(f"linear: x has K={k} (shape {tuple(x.shape)}) but weight is {tuple(w.shape)} (stored (N, K))")
  if bias is not None and tuple(bias.shape) != (n,):
    raise ValueError(f"linear: bias must be (N,) = ({n},) for weight {tuple(w.shape)} (stored (N, K)), got shape "
                     f"{tuple(bias.shape)}")
  if math.prod(lead) == 0:  # no rows: nothing to quantize (a 1x128 group of no tokens has no scale)
    return jnp.zeros((*lead, n), cfg.out_dtype)
  lora = _lora()
  if isinstance(w, lora.LoRAWeight):  # frozen base + low-rank adapters: fp8jax.lora's op, itself made of linears
    return lora.lora_linear(x, w, cfg, parallel, bias=bias)
  out_dtype = cfg.out_dtype
  if bias is not None:  # the GEMM's FP32 accumulator, rounded once after the bias add below
    cfg = dataclasses.replace(cfg, out_dtype="float32")
  x_MxK = x.reshape(-1, k)
  if isinstance(w, quant.FP8Weight):
    y = _linear_fp8_master(x_MxK, w.w, cfg)
  elif isinstance(w, quant.QWeight):
    y = _linear_fp8_frozen(x_MxK, w, cfg)
  else:
    y = _linear_bf16(x_MxK, w, cfg)
  if bias is not None:
    y = (y + bias.astype(jnp.bfloat16).astype(jnp.float32)).astype(out_dtype)
  return y.reshape(*lead, y.shape[-1])


# ------------------------------------------------------------------------------------------------------------------
# The grouped (mixture-of-experts) linear op
# ------------------------------------------------------------------------------------------------------------------


def _grouped_gemm(a_q_PxK, a_s_PxKb, b_q_ExNxK, b_s, tile_expert_T, out_dtype, cfg: LinearConfig):
  """The grouped FP8 GEMM on the tile buffer: the grouped Hopper kernel where the backend is "pallas", else the
  reference (each group's rows bitwise the dense op either way). Rows of unused tiles are unspecified (the kernel
  skips them; the reference writes zeros): nothing downstream reads them."""
  if resolve_backend(cfg.backend) == "pallas":
    return _pallas_grouped_gemm()(a_q_PxK, a_s_PxKb, b_q_ExNxK, b_s, tile_expert_T, out_dtype=out_dtype)
  return grouped_ref.gemm_tiles_reference(a_q_PxK, a_s_PxKb, b_q_ExNxK, b_s, tile_expert_T, out_dtype)


def _grouped_forward_q(x_PxK, qw: quant.QWeight, tile_expert_T, cfg: LinearConfig):
  xq, xs = quantize_act(quant.pad_k(x_PxK), cfg.pow2_scales, cfg.backend)
  return _grouped_gemm(xq, xs, quant.pad_k(qw.q, -1), qw.scale, tile_expert_T, jnp.dtype(cfg.out_dtype), cfg)


def _grouped_dgrad(dy_PxN, qw: quant.QWeight, tile_expert_T, k: int, dtype, cfg: LinearConfig):
  """dx = Q(dy)[1x128 over N] . Q(w_e)^T per group (``_dgrad``'s operands, stacked over experts)."""
  dyq, dys = quantize_act(quant.pad_k(dy_PxN), cfg.pow2_scales, cfg.backend)
  wt_ExKxN = quant.pad_k(quant.pad_k(jnp.swapaxes(qw.q, -1, -2), -1), -2)
  dx = _grouped_gemm(dyq, dys, wt_ExKxN, jnp.swapaxes(qw.scale, -1, -2), tile_expert_T, jnp.dtype(dtype), cfg)
  return dx[:, :k]


def _grouped_wgrad(dy_PxN, x_PxK, tile_expert_T, num_experts: int, cfg: LinearConfig):
  """dw_e = Q(dy_e^T)[1x128 over tokens] . Q(x_e^T)[1x128 over tokens], token groups from group e's first row
  (a tile boundary: every tile belongs to one group) -> (E, N, K) FP32: the grouped wgrad kernel on "pallas"
  (N and K zero-padded to 128 there), else the reference (the same per-block math and order)."""
  aq, as_ = quantize_act_t(dy_PxN, cfg.pow2_scales, cfg.backend)
  bq, bs = quantize_act_t(x_PxK, cfg.pow2_scales, cfg.backend)
  if resolve_backend(cfg.backend) == "pallas":
    n, k = dy_PxN.shape[1], x_PxK.shape[1]
    pad = lambda q, s: (quant.pad_k(q, 0), quant.pad_k(s, 0))  # noqa: E731 (zero rows: zero dW rows, sliced off)
    dw = _pallas_grouped_wgrad()(*pad(aq, as_), *pad(bq, bs), tile_expert_T, num_experts=num_experts)
    return dw[:, :n, :k]
  return grouped_ref.grouped_wgrad_tiles(aq, as_, bq, bs, tile_expert_T, num_experts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_fp8_master(x_PxK, w_ExNxK, tile_expert_T, cfg: LinearConfig):
  return _grouped_forward_q(x_PxK, quant.quantize_weight(w_ExNxK, cfg.pow2_scales), tile_expert_T, cfg)


def _grouped_master_fwd(x_PxK, w_ExNxK, tile_expert_T, cfg):
  qw = quant.quantize_weight(w_ExNxK, cfg.pow2_scales)
  y = _grouped_forward_q(x_PxK, qw, tile_expert_T, cfg)
  return y, (x_PxK, qw, tile_expert_T, jnp.zeros((), w_ExNxK.dtype))


def _grouped_master_bwd(cfg, res, dy_PxN):
  x_PxK, qw, tile_expert_T, w_dtype_tag = res
  dx = _grouped_dgrad(dy_PxN, qw, tile_expert_T, x_PxK.shape[1], x_PxK.dtype, cfg)
  dw = _grouped_wgrad(dy_PxN, x_PxK, tile_expert_T, qw.q.shape[0], cfg)
  return dx, dw.astype(w_dtype_tag.dtype), None


_grouped_fp8_master.defvjp(_grouped_master_fwd, _grouped_master_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_fp8_frozen(x_PxK, qw: quant.QWeight, tile_expert_T, cfg: LinearConfig):
  return _grouped_forward_q(x_PxK, qw, tile_expert_T, cfg)


def _grouped_frozen_fwd(x_PxK, qw, tile_expert_T, cfg):
  y = _grouped_forward_q(x_PxK, qw, tile_expert_T, cfg)
  return y, (qw, tile_expert_T, jnp.zeros((0, x_PxK.shape[1]), x_PxK.dtype))


def _grouped_frozen_bwd(cfg, res, dy_PxN):
  qw, tile_expert_T, x_tag = res
  dx = _grouped_dgrad(dy_PxN, qw, tile_expert_T, x_tag.shape[1], x_tag.dtype, cfg)
  return dx, jax.tree.map(jnp.zeros_like, qw), None


_grouped_fp8_frozen.defvjp(_grouped_frozen_fwd, _grouped_frozen_bwd)


def _grouped_bf16_gemm(a_PxK, b_ExNxK, tile_expert_T, cfg: LinearConfig):
  """BF16 grouped ``a . b_e^T`` per tile -> (P, N) FP32: the grouped Hopper kernel in BF16 mode on "pallas" (N and K
  zero-padded to 128 as ``_bf16_gemm`` does; each group's rows bitwise the dense kernel's), else
  ``dot_tiles_reference`` (each group's rows bitwise ``invariant_dot``)."""
  if resolve_bf16_backend(cfg.backend) == "pallas":
    n = b_ExNxK.shape[1]
    out = _pallas_grouped_bf16_gemm()(quant.pad_k(a_PxK), quant.pad_k(quant.pad_k(b_ExNxK), -2), tile_expert_T,
                                      out_dtype=jnp.float32)
    return out[:, :n] if out.shape[1] != n else out
  return grouped_ref.dot_tiles_reference(a_PxK, b_ExNxK, tile_expert_T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_bf16(x_PxK, w_ExNxK, tile_expert_T, cfg: LinearConfig):
  """BF16 mode. A custom VJP (not autodiff of the tile loop, which would sum each expert's per-tile dw in BF16). On
  "xla" dx and dw are, per group, bitwise the dense BF16 ``linear``'s autodiff; on "pallas" the forward and dx run
  the grouped kernel (per group bitwise the dense kernel's rows) and dw the grouped BF16 wgrad kernel (FP32 sums
  over each expert's tokens in order: within FP32 rounding of the reference's one dot per group)."""
  y = _grouped_bf16_gemm(x_PxK.astype(jnp.bfloat16), w_ExNxK.astype(jnp.bfloat16), tile_expert_T, cfg)
  return y.astype(cfg.out_dtype)


def _grouped_bf16_fwd(x_PxK, w_ExNxK, tile_expert_T, cfg):
  return _grouped_bf16(x_PxK, w_ExNxK, tile_expert_T, cfg), (x_PxK, w_ExNxK, tile_expert_T)


def _grouped_bf16_bwd(cfg, res, dy_PxN):
  x_PxK, w_ExNxK, tile_expert_T = res
  ct = dy_PxN.astype(jnp.float32)  # the cotangent of the FP32 dot, as in linear's autodiff
  xb, wb = x_PxK.astype(jnp.bfloat16), w_ExNxK.astype(jnp.bfloat16)
  if resolve_bf16_backend(cfg.backend) == "pallas":
    # dy in BF16 for the tensor cores, as the dense kernel's VJP (exact for BF16 outputs)
    dx = _grouped_bf16_gemm(ct.astype(jnp.bfloat16), jnp.swapaxes(wb, 1, 2), tile_expert_T, cfg)
    # dy in BF16 as for dx (the dense kernel's VJP does the same), dw rounded to BF16 as the reference's dw (and the
    # dense kernel's VJP) is, before the master's dtype
    n, k = dy_PxN.shape[1], x_PxK.shape[1]
    dw = _pallas_grouped_bf16_wgrad()(quant.pad_k(ct.astype(jnp.bfloat16)).T, quant.pad_k(xb).T, tile_expert_T,
                                      num_experts=w_ExNxK.shape[0])[:, :n, :k].astype(jnp.bfloat16)
  else:
    dx = grouped_ref.dot_tiles_dgrad(ct, wb, tile_expert_T)
    dw = grouped_ref.dot_tiles_wgrad(ct, xb, tile_expert_T, w_ExNxK.shape[0])
  return dx.astype(x_PxK.dtype), dw.astype(w_ExNxK.dtype), None


_grouped_bf16.defvjp(_grouped_bf16_fwd, _grouped_bf16_bwd)


def _check_grouped_weight(name: str, w, x_shape):
  """The expert weight's checks shared by ``grouped_linear`` and ``grouped_linear_tiles``: (E, N, K), scales."""
  k = x_shape[1]
  if len(w.shape) != 3:
    raise ValueError(f"{name}: weight must be 3-D, stored (E, N, K) = (experts, out, in), got shape "
                     f"{tuple(w.shape)}")
  e, n, kw = w.shape
  if k != kw:
    raise ValueError(f"{name}: x has K={k} (shape {tuple(x_shape)}) but weight is {tuple(w.shape)} (stored (E, N, K))")
  if isinstance(w, quant.QWeight) and w.scale.shape != (e, quant.num_blocks(n), quant.num_blocks(kw)):
    raise ValueError(f"{name}: QWeight scale must be (E, ceil(N/128), ceil(K/128)) = "
                     f"{(e, quant.num_blocks(n), quant.num_blocks(kw))} for q {tuple(w.q.shape)}, got "
                     f"{tuple(w.scale.shape)}")


def grouped_linear_tiles(x_PxK: jax.Array, w, tile_expert_T: jax.Array,
                         cfg: LinearConfig = LinearConfig()) -> jax.Array:
  """``grouped_linear`` on rows already in the tile layout (``pallas_kernels.grouped_gemm.layout``): ``x_PxK``'s
  128-row tile t belongs to expert ``tile_expert_T[t]`` (>= E: unused), each group starting on a tile boundary and
  zero rows between groups. -> (P, N); rows of unused tiles are unspecified (never read them). For callers that
  keep their rows in this layout across several expert GEMMs (the MoE block: gate, up and down share one layout),
  which saves ``grouped_linear``'s moves in and out of it. Same modes, numerics and gradients as ``grouped_linear``
  (the cotangent of an unused tile's rows does not reach the weights)."""
  if x_PxK.ndim != 2 or x_PxK.shape[0] != tile_expert_T.shape[0] * quant.BLOCK:
    raise ValueError(f"grouped_linear_tiles: x must be (P, K) with P = 128 x tiles = 128 x "
                     f"{tile_expert_T.shape[0]} (tile_expert_T {tuple(tile_expert_T.shape)}), got shape "
                     f"{tuple(x_PxK.shape)}")
  _check_grouped_weight("grouped_linear_tiles", w, x_PxK.shape)
  _refuse_complex("grouped_linear_tiles", x_PxK, w)
  tile_expert_T = tile_expert_T.astype(jnp.int32)
  if isinstance(w, quant.FP8Weight):
    return _grouped_fp8_master(x_PxK, w.w, tile_expert_T, cfg)
  if isinstance(w, quant.QWeight):
    return _grouped_fp8_frozen(x_PxK, w, tile_expert_T, cfg)
  return _grouped_bf16(x_PxK, w, tile_expert_T, cfg)


def grouped_linear(x_MxK: jax.Array, w, group_sizes_E: jax.Array, cfg: LinearConfig = LinearConfig()) -> jax.Array:
  """The expert GEMM of a mixture-of-experts layer: row i of ``x_MxK`` times ``w_e^T`` for the group e it is in.

  Rows are sorted by group: ``off = exclusive_cumsum(group_sizes_E)`` (integers, may be traced; E static), rows
  ``[off_e, off_e + size_e)`` use expert e; rows at or beyond ``sum(group_sizes_E)`` give zeros (and zero dx).
  ``w`` is stored (E, N, K), each expert like a ``linear`` weight, and its type picks the mode as in ``linear``:
  plain array -> BF16; ``FP8Weight`` wrapping an (E, N, K) master -> FP8 forward,
  dgrad and wgrad (dw (E, N, K) in the master's dtype; each expert's tokens quantized 1x128 over tokens starting at
  its group's first row); ``QWeight`` with q (E, N, K) and scale (E, N/128, K/128) -> frozen-weight forward + dgrad.
  Numerics: each group's rows of y, dx and each dw_e are bitwise ``linear`` (and its VJP) applied to that group's
  rows alone (batch-invariant math; ``pallas_kernels.grouped_gemm``), checked on CPU and, for the grouped Hopper
  kernel that the FP8 forward and dgrad run on the "pallas" backend, on the H200 (tests/test_grouped.py,
  tests/test_grouped_kernel.py). The FP8 wgrad runs the reference on every backend (no grouped wgrad kernel yet).
  """
  if x_MxK.ndim != 2:
    raise ValueError(f"grouped_linear: x must be 2-D (M, K) rows sorted by group, got shape {tuple(x_MxK.shape)}")
  _check_grouped_weight("grouped_linear", w, x_MxK.shape)
  group_sizes_E = jnp.asarray(group_sizes_E)
  e, n, _ = w.shape
  if e == 0 or group_sizes_E.ndim != 1 or group_sizes_E.shape[0] != e:
    raise ValueError(f"grouped_linear: group_sizes must be 1-D with one size per expert (E={e} from weight "
                     f"{tuple(w.shape)}), got shape {tuple(group_sizes_E.shape)}")
  if not jnp.issubdtype(group_sizes_E.dtype, jnp.integer):
    raise ValueError(f"grouped_linear: group_sizes must be integers, got {group_sizes_E.dtype}")
  _refuse_complex("grouped_linear", x_MxK, w)
  m = x_MxK.shape[0]
  if m == 0:
    return jnp.zeros((0, n), cfg.out_dtype)
  dest_M, tile_expert_T = grouped_ref.layout(group_sizes_E.astype(jnp.int32), m)
  x_PxK = grouped_ref.to_tiles(x_MxK, dest_M, grouped_ref.padded_rows(m, e))
  return grouped_ref.from_tiles(grouped_linear_tiles(x_PxK, w, tile_expert_T, cfg), dest_M)
