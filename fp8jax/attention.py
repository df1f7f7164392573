"""The attention op: one call for the training forward, prefill and decode, on one numerics contract.

``attend(q, k, v, positions, ...)`` is what the model calls (fp8jax/model/llama.py). The contract (fixed 128-key
blocks visited in order, the same online-softmax update for every query row, no split over keys) is written out
in ``pallas_kernels.attention``; both backends follow it:

* "pallas": the kernels of ``pallas_kernels.attention_triton`` (one tile body for the three callers, so decode rows
  equal the training rows bit for bit on the GPU), with a custom VJP whose backward is a flash backward: no T x T
  tensor in the forward or the backward;
* "xla": ``attention_reference`` in plain jnp (autodiff gives its gradient). On CPU its rows are computed with
  shape-independent code, so decode rows equal training rows bit for bit there too (tests/test_attention.py).
"auto" picks "pallas" on a CUDA GPU and "xla" elsewhere; operands the kernels do not take (head_dim, dtype) fall
back to the reference with a logged warning, and every choice is listed in ``backends.backend_report()`` under
``attention:``, so a change of numerics is never silent. "pallas" raises where the kernels cannot run.

K/V forms: BF16 values (no scales), or E4M3 codes with per-layer FP32 scales applied after the dots (the FP8 KV
recipe; passing ``k_scale`` says the K/V are codes): the cache's float8_e4m3fn arrays in the sampler, the same codes
as BF16 values (``kvcache.kv_codes``, straight-through) in the trainer. ``k_scale`` goes into the scores, ``v_scale``
into the output. Codes take the contract's FP16 dot operands on every backend (``pallas_kernels.attention``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp8jax import backends, sharding

from pallas_kernels import attention as ref

@functools.cache
def _kernels():
  from pallas_kernels import attention_triton  # noqa: PLC0415 (imports the Pallas Triton backend only when asked for)
  return attention_triton


_gpu_available = backends.gpu_available


def resolve_backend(requested: str, q, k) -> str:
  """'auto' | 'xla' | 'pallas' -> the backend that runs these operands (``backends.choose_backend``)."""
  def probe():
    if not _gpu_available():
      return False, "no CUDA GPU"
    try:
      why = _kernels().unsupported(q, k)
    except ImportError as e:  # kernel module missing or broken: say so, never silently
      return False, f"pallas kernels unavailable ({e})"
    return (True, "CUDA GPU") if why is None else (False, f"fallback to the reference: {why}")

  return backends.choose_backend(requested, what="attention", config_key="model.attn_backend", probe=probe,
                            prefix="attention:")


def _scales(d: int, k_scale, v_scale, sm_scale=None):
  """(qk_scale, v_scale) FP32 scalars: scores in log2 units, k_scale * sm_scale * log2(e) times the raw dot, where
  sm_scale is 1/sqrt(D) unless given."""
  c = jnp.float32(ref.LOG2E / math.sqrt(d) if sm_scale is None else ref.LOG2E * sm_scale)
  qk = c if k_scale is None else jnp.asarray(k_scale, jnp.float32) * c
  return qk, jnp.float32(1.0) if v_scale is None else jnp.asarray(v_scale, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash_train(q, k, v, qk_scale, v_scale, cfg, codes=False):
  return _flash_train_fwd(q, k, v, qk_scale, v_scale, cfg, codes)[0]


def _positions(q):
  b, t = q.shape[:2]
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _flash_train_fwd(q, k, v, qk_scale, v_scale, cfg, codes=False):
  # Codes (BF16 holding E4M3 values) go to the kernel as FP16, exact: the sampler's FP16 operands, no conversion in
  # the tile; the gradients stay in k's dtype (the backward reads the BF16 codes).
  kk, vv = (k.astype(jnp.float16), v.astype(jnp.float16)) if codes else (k, v)
  out, lse = _kernels().attention_seq(q, kk, vv, _positions(q), qk_scale, v_scale, config=cfg)
  return out, (q, k, v, qk_scale, v_scale, out, lse)


def _flash_train_bwd(cfg, codes, res, do):
  q, k, v, qk_scale, v_scale, out, lse = res
  dq, dk, dv = _kernels().attention_seq_bwd(q, k, v, _positions(q), qk_scale, v_scale, out, lse, do,
                                            causal_rows=True, kv_codes=codes, config=cfg)
  return dq, dk, dv, jnp.zeros_like(qk_scale), jnp.zeros_like(v_scale)


_flash_train.defvjp(_flash_train_fwd, _flash_train_bwd)


def _per_device(fn, mesh, q, k, n_batched: int, n_replicated: int = 2, paged: bool = False, shared: bool = False):
  """``fn`` per device under ``shard_map`` (``sharding.per_device``), else ``fn`` as is.

  Pallas kernels are opaque to XLA's SPMD partitioner: inside a sharded jit their operands would be gathered and
  every device would compute every sequence and head. Attention rows of different sequences, and different KV-head
  groups, are independent, so each device attends its own sequences (batch axes of ``mesh``) and, on a "tensor"
  axis that divides both the query and the KV heads, its own heads (the tensor-parallel layout of wq/wk/wv, whose
  contiguous head blocks keep each query head with its KV head): the same computation, bitwise, the kernels being
  batch invariant. The first ``n_batched`` operands are (B, T, H, D) activations / caches (positions (B, T)), the
  next ``n_replicated`` replicated scalars. ``paged``: k/v are page pools shared by all sequences (split by heads
  only; each device holds every page) and a (B, Nb) page table follows the scalars, split like the positions;
  ``shared``: then a (B,) shared-prefix block count, split alike (each device groups its own sequences).
  """
  axes = sharding.split_batch_axes(mesh, q.shape[0])
  tp = sharding.tensor_axis(mesh)
  if tp is not None and (q.shape[2] % mesh.shape[tp] or k.shape[2] % mesh.shape[tp]):
    tp = None
  if axes is None and tp is None:
    return fn
  P = jax.sharding.PartitionSpec
  heads = P(axes, None, tp, None)
  kv = P(None, None, tp, None) if paged else heads
  batched = (heads, kv, kv, P(axes, None))[:n_batched]
  tail = ((P(axes, None),) if paged else ()) + ((P(axes),) if shared else ())
  return sharding.per_device(fn, mesh, batched + (P(),) * n_replicated + tail, heads)


def attend(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, positions_BxT=None, *, k_scale=None, v_scale=None,
           sm_scale: float | None = None, backend: str = "auto", mesh=None, page_table=None, shared_blocks=None,
           pair_ordered: bool = False):
  """Causal GQA attention -> out_BxTxHxD in q's dtype (contract: ``pallas_kernels.attention``).

  positions_BxT=None: the training form, queries and keys are the same T positions 0..T-1 (differentiable in q, k,
  v). Otherwise the cache form (prefill T > 1, decode T = 1): query t of row b is at positions_BxT[b, t] and sees the
  cache entries 0..positions_BxT[b, t] (forward only). k/v: BF16 values or codes, or float8_e4m3fn codes (cache);
  ``k_scale`` given: they are codes (FP16 dot operands).
  ``mesh``: with the pallas backend on a multi-device mesh, each device attends its own sequences (and heads).
  ``sm_scale``: the softmax scale (a Python float; default 1/sqrt(D)): MLA's absorbed form attends over
  kv_lora_rank + qk_rope_head_dim dims but scales by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (x YaRN's mscale^2).
  ``page_table`` (B, Nb) int32: the paged cache form (``fp8jax.kvcache``): k/v are page pools (N, key block, K, D)
  and key block n of row b is page page_table[b, n]; positions_BxT is required (forward only).
  ``shared_blocks`` (B,) int32, paged decode only: row b's first shared_blocks[b] pages are the same pages for
  every row with the same first page and count, and its query sees them in full (the samples of one prompt): the
  kernels then read those pages once per group (``attention_triton.attention_heads``), with the same bits. The
  reference backend, prefill and G > the decode tile ignore it (nothing to gain; same numbers).
  ``pair_ordered`` (cache forms): k/v are float8 codes whose head dims are in pair order
  (``pallas_kernels.attention.pair_order``, the sampler's FP8 cache on a GPU): the kernels read them as they are,
  the reference puts them back in natural order first (exact).
  """
  b, t, h, d = q_BxTxHxD.shape
  if page_table is not None and positions_BxT is None:
    raise ValueError("attend: a page table (the paged cache form) needs positions_BxT")
  if positions_BxT is None and k_BxSxKxD.shape[1] != t:
    raise ValueError(f"attend: the training form (no positions) needs as many keys as queries, got q "
                     f"{q_BxTxHxD.shape} and k {k_BxSxKxD.shape}; pass positions_BxT for a cache")
  pos = _positions(q_BxTxHxD) if positions_BxT is None else positions_BxT.astype(jnp.int32)
  qk_scale, vs = _scales(d, k_scale, v_scale, sm_scale)
  codes = ref.is_codes(k_BxSxKxD, k_scale is not None)
  if pair_ordered and positions_BxT is None:
    raise ValueError("attend: pair_ordered is a cache form (pass positions_BxT)")
  if resolve_backend(backend, q_BxTxHxD, k_BxSxKxD) == "xla":
    if pair_ordered:
      k_BxSxKxD, v_BxSxKxD = ref.natural_order(k_BxSxKxD), ref.natural_order(v_BxSxKxD)
    return ref.attention_reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, pos, qk_scale, vs, page_table_BxNb=page_table,
                                   kv_codes=codes)[0]
  ref.check_operands(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, pos, page_table, ref.BLOCK_KV)
  kern = _kernels()
  cfg = kern.TuningConfig()
  if positions_BxT is None:
    fn = lambda q, k, v, qs, s: _flash_train(q, k, v, qs, s, cfg, codes)  # noqa: E731
    return _per_device(fn, mesh, q_BxTxHxD, k_BxSxKxD, 3)(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, qk_scale, vs)
  if codes and k_BxSxKxD.dtype == q_BxTxHxD.dtype:  # codes held in BF16 over a cache: FP16 operands, as in the tile
    k_BxSxKxD, v_BxSxKxD = k_BxSxKxD.astype(jnp.float16), v_BxSxKxD.astype(jnp.float16)
  paged = page_table is not None
  g = h // k_BxSxKxD.shape[2]
  shared = paged and t == 1 and shared_blocks is not None and g <= kern.prefix_rows(cfg, g)
  po = pair_ordered
  if t == 1:
    fn = lambda q, k, v, p, qs, s, *pt: kern.attention_heads(q[:, 0], k, v, p[:, 0], qs, s, *pt,  # noqa: E731
                                                            config=cfg, pair_ordered=po)[:, None]
  else:
    fn = lambda q, k, v, p, qs, s, *pt: kern.attention_seq(q, k, v, p, qs, s, *pt, config=cfg,  # noqa: E731
                                                          pair_ordered=po)[0]
  extra = ((page_table.astype(jnp.int32),) if paged else ()) + ((shared_blocks.astype(jnp.int32),) if shared else ())
  return _per_device(fn, mesh, q_BxTxHxD, k_BxSxKxD, 4, paged=paged, shared=shared)(
      q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, pos, qk_scale, vs, *extra)
