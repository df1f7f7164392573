"""Block-scaled FP8 GEMM ``C = A . B^T`` for Hopper (sm_90) in Pallas Mosaic GPU.

Operands and math are those of ``pallas_kernels.fp8_gemm`` (read its docstring): A E4M3 (M, K) with 1x128 FP32
scales (M, K/128); B E4M3 stored (N, K) (K-major, as FP8 wgmma needs) with either 128x128 tile scales
(ceil(N/128), K/128) [forward / dgrad] or 1x128 row scales (N, K/128) [wgrad].

Kernel structure (the DeepGEMM recipe, DeepSeek-V3 report sec. 3.3.2 "increasing accumulation precision", written
from scratch on the Pallas primitives; jax's ``hopper_matmul_mgpu.py`` shows the warp-specialized pattern):

1. Persistent grid: one CTA per SM walks the output tiles in a planar-snake order (``plgpu.planar_snake``), so
   CTAs that run at the same time share A rows / B columns in L2.
2. Warp specialization: 3 warpgroups per CTA. The last is the producer (``emit_pipeline_warp_specialized``):
   it issues TMA copies of A (cta_m x 128), B (cta_n x 128) and the two scale rows for each 128-wide K block into a
   ``max_concurrent_steps``-deep ring of 128B-swizzled SMEM buffers, and gives most registers to the two
   consumer warpgroups (``setmaxnreg``).
3. Each consumer warpgroup owns a 64 x wg_n block of C. Per K block it (a) issues 4 FP8 wgmmas (k32 each) into a
   fresh zeroed FP32 accumulator, (b) reads its scales from SMEM while they run, (c) waits and promotes:
   ``acc += blk * (a_scale[m] * b_scale[n])`` in FP32 registers. The tensor cores' FP8 accumulator keeps only
   ~14 mantissa bits, so promoting every 128 K values is what keeps the result at FP32 accuracy; and because each
   output element sees exactly the same instruction sequence in the same K order for every tile config, grid size
   and M, a row of C is bitwise the same whatever M is and wherever the row sits (batch invariance; tested on GPU).
4. Epilogue: the FP32 accumulator is cast to the output dtype, stored to swizzled SMEM and written by TMA.

Scales reach registers through SMEM: A's scales are passed transposed (K/128, M) so a CTA's 1 x cta_m scale row is a
TMA-able contiguous block; B's 128x128 tile scales are replicated 32x along N (128 bytes: every ring slot then
starts 128-byte aligned, as TMA needs) so the scale of one 128-column block is one TMA box. Both are tiny XLA ops in
the wrapper. For the same reason row-scale (wgrad) calls use CTAs at least 32 columns wide.

M is padded to the CTA height inside the wrapper (zero rows, sliced off the result); N and K must be multiples
of 128 (a ValueError otherwise). Tile configs per shape class: ``choose_config``. Measured figures, and what limits
them: docs/benchmarks.md, "FP8 block GEMM (issue 3)".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_gemm import BLOCK, check_operands

WG_M = 64  # rows of C per consumer warpgroup: one m64 wgmma row block.
NUM_COMPUTE_WGS = 2
# Tile scales are replicated 32x along N: 32 x f32 = 128 bytes, so that every slot of the scale ring in SMEM
# starts 128-byte aligned, as TMA (cp.async.bulk.tensor) requires of its SMEM destination.
_SCALE_REP = 32


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Tile shape and pipeline depth of one kernel instance.

  split: how the two consumer warpgroups share the CTA tile: "m" -> CTA 128 x wg_n, "n" -> CTA 64 x 2*wg_n.
  wg_n: columns of C per warpgroup (the wgmma N); divides 128 so that one B tile scale covers it.
  max_concurrent_steps: SMEM ring depth (K blocks in flight).
  grid_minor_dim / grid_tile_width: planar-snake tile order (L2 reuse).
  """

  split: str = "m"
  wg_n: int = 128
  max_concurrent_steps: int = 4
  grid_minor_dim: str = "n"
  grid_tile_width: int = 8

  def __post_init__(self):
    if self.split not in ("m", "n"):
      raise ValueError(f"TuningConfig.split must be 'm' or 'n', got {self.split!r}")
    if self.wg_n not in (16, 32, 64, 128):
      raise ValueError(f"TuningConfig.wg_n must be 16, 32, 64 or 128 (divides 128), got {self.wg_n}")
    if not 2 <= self.max_concurrent_steps <= 12:
      raise ValueError(f"TuningConfig.max_concurrent_steps must be in [2, 12], got {self.max_concurrent_steps}")
    if self.grid_minor_dim not in ("m", "n"):
      raise ValueError(f"TuningConfig.grid_minor_dim must be 'm' or 'n', got {self.grid_minor_dim!r}")
    if self.grid_tile_width < 1:
      raise ValueError(f"TuningConfig.grid_tile_width must be >= 1, got {self.grid_tile_width}")

  @property
  def cta_m(self) -> int:
    return WG_M * (NUM_COMPUTE_WGS if self.split == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.wg_n * (NUM_COMPUTE_WGS if self.split == "n" else 1)


def _num_sms() -> int:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return 132
  return getattr(dev, "core_count", 0) or 132


def choose_config(m: int, n: int, k: int, num_sms: int | None = None) -> TuningConfig:
  """Tile config per shape class (decode: small M, prefill/training: large M).

  Every config computes each output element with the same instruction sequence (module docstring, item 3), so the
  choice changes speed, never bits (the GPU test checks all configs bitwise). The largest CTA tile whose grid still
  fills ~3/4 of the SMs wins: 128x128 for prefill/training, 128x64 for M ~ 256, and 64-row CTAs narrowed over N for
  decode (M <= 64, no padding to 128), where the GEMM is bound by reading B. Measured on the H200, 2026-11-30
  (docs/benchmarks.md): 4 stages beat 5-6 by 1-3% at M = 8192; for M = 256 the o/qkv/down shapes gain ~1.4x from
  128x64 over 64x64 CTAs.
  """
  del k
  num_sms = num_sms or _num_sms()
  enough = (3 * num_sms) // 4
  T = TuningConfig
  cands = [T("m", 128, 4), T("m", 64, 6)] if m > WG_M else []
  cands += [T("n", 64, 8), T("n", 32, 8), T("n", 16, 8)]
  for cfg in cands:
    if n % cfg.cta_n == 0 and -(-m // cfg.cta_m) * (n // cfg.cta_n) >= enough:
      return cfg
  return cands[-1]


_SMEM_BUDGET = 220 * 1024  # of the 227 KiB an sm_90 CTA may use; the rest is left for barriers.


def _fit_stages(cfg: TuningConfig, out_dtype, row_scales: bool) -> TuningConfig:
  """Shrinks the SMEM ring so that ring + epilogue buffer fit (FP32 outputs need twice the epilogue bytes)."""
  bs_cols = cfg.cta_n if row_scales else _SCALE_REP * max(1, cfg.cta_n // BLOCK)
  stage = (cfg.cta_m + cfg.cta_n) * BLOCK + 4 * (cfg.cta_m + bs_cols)
  out = NUM_COMPUTE_WGS * WG_M * cfg.wg_n * jnp.dtype(out_dtype).itemsize
  stages = min(cfg.max_concurrent_steps, (_SMEM_BUDGET - out) // stage)
  return dataclasses.replace(cfg, max_concurrent_steps=stages)


def _swizzled(shape_minor_bytes: int, itemsize: int):
  swizzle = plgpu.find_swizzle(shape_minor_bytes * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel(a_gmem, b_gmem, as_gmem, bs_gmem, out_gmem, out_smem, *, cfg: TuningConfig, row_scales: bool):
  """Refs: a (Mp, K) e4m3, b (N, K) e4m3, as (Kb, Mp) f32, bs (Kb, 4*Nb | N) f32, out (Mp, N)."""
  mp, k = a_gmem.shape
  n = b_gmem.shape[0]
  out_dtype = out_gmem.dtype
  cta_m, cta_n, wg_n = cfg.cta_m, cfg.cta_n, cfg.wg_n
  m_iters, n_iters, k_iters = mp // cta_m, n // cta_n, k // BLOCK
  fp8_transforms = _swizzled(BLOCK, 1)  # 128 B rows -> 128 B swizzle
  # Columns of bs a CTA needs: its own (row scales) or the replicated scale of each 128-wide block it touches.
  bs_cols = cta_n if row_scales else _SCALE_REP * max(1, cta_n // BLOCK)

  def get_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((cta_m, BLOCK), lambda kk: (0, kk), transforms=fp8_transforms,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((cta_n, BLOCK), lambda kk: (0, kk), transforms=fp8_transforms,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((1, cta_m), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
            plgpu.BlockSpec((1, bs_cols), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=NUM_COMPUTE_WGS,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=get_pipeline(ignore, ignore).get_allocations(
          a_gmem.at[pl.ds(0, cta_m)], b_gmem.at[pl.ds(0, cta_n)],
          as_gmem.at[:, pl.ds(0, cta_m)], bs_gmem.at[:, pl.ds(0, bs_cols)]),
      collective_axes="wg",
  )
  def _scope(allocs):
    wg = lax.axis_index("wg")
    minor = {"m": 0, "n": 1}[cfg.grid_minor_dim]

    # (1) Persistent loop over output tiles.
    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info: plgpu.NDLoopInfo):
      (lin,) = info.index
      m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), minor, cfg.grid_tile_width)
      m0 = m_idx * cta_m
      n0 = n_idx * cta_n
      if cfg.split == "m":
        wg_m_off, wg_n_off = wg * WG_M, 0
      else:
        wg_m_off, wg_n_off = 0, wg * wg_n
      if row_scales:
        bs_start = n0
        bs_col = wg_n_off
      else:
        nb0 = n0 // BLOCK
        bs_start = nb0 * _SCALE_REP
        bs_col = ((n0 + wg_n_off) // BLOCK - nb0) * _SCALE_REP

      def compute_context(eval_pipeline):
        acc0 = plgpu.layout_cast(jnp.zeros((WG_M, wg_n), jnp.float32), plgpu.Layout.WGMMA)
        acc = eval_pipeline(acc0)
        # (4) Epilogue: registers -> swizzled SMEM -> TMA store.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg], out_gmem.at[pl.ds(m0 + wg_m_off, WG_M), pl.ds(n0 + wg_n_off, wg_n)])

      # (3) One 128-wide K block: fresh FP8 wgmma accumulation, then FP32 promotion with the block's scales.
      def mma_body(_, a_smem, b_smem, as_smem, bs_smem, acc):
        def block_dot(blk_ref):
          plgpu.wgmma(blk_ref, a_smem.at[pl.ds(wg_m_off, WG_M)],
                      b_smem.at[pl.ds(wg_n_off, wg_n)].transpose((1, 0)))
          # Scale loads overlap the wgmmas in flight.
          sa = plgpu.load(as_smem.at[0, pl.ds(wg_m_off, WG_M)], layout=plgpu.Layout.WGMMA.reduce(1))
          if row_scales:
            sb = plgpu.load(bs_smem.at[0, pl.ds(bs_col, wg_n)], layout=plgpu.Layout.WGMMA.reduce(0))
          else:
            sb = bs_smem[0, bs_col]
          return blk_ref[...], sa, sb

        blk, sa, sb = pl.run_scoped(block_dot, plgpu.ACC((WG_M, wg_n), jnp.float32))
        if row_scales:
          scale = (lax.broadcast_in_dim(sa, (WG_M, wg_n), [0])
                   * lax.broadcast_in_dim(sb, (WG_M, wg_n), [1]))
        else:
          scale = lax.broadcast_in_dim(sa * sb, (WG_M, wg_n), [0])
        return acc + blk * scale

      get_pipeline(mma_body, compute_context)(
          a_gmem.at[pl.ds(m0, cta_m)],
          b_gmem.at[pl.ds(n0, cta_n)],
          as_gmem.at[:, pl.ds(m0, cta_m)],
          bs_gmem.at[:, pl.ds(bs_start, bs_cols)],
          allocations=allocs,
      )

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _validate(a_q, a_s, b_q, b_s):
  check_operands(a_q, a_s, b_q, b_s)
  n = b_q.shape[0]
  if n % BLOCK:
    raise ValueError(f"fp8_gemm (Mosaic GPU): N = {n} (B {tuple(b_q.shape)}) must be a multiple of {BLOCK}")
  if a_q.shape[0] == 0:
    raise ValueError(f"fp8_gemm (Mosaic GPU): M must be >= 1, got A {tuple(a_q.shape)}")


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "num_sms"))
def fp8_gemm(a_q, a_s, b_q, b_s, *, out_dtype=jnp.bfloat16, config: TuningConfig | None = None,
             interpret: bool = False, num_sms: int | None = None):
  """C = A . B^T with block-scaled E4M3 operands (layouts in the module docstring); returns (M, N) ``out_dtype``."""
  _validate(a_q, a_s, b_q, b_s)
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"fp8_gemm (Mosaic GPU): out_dtype must be bfloat16 or float32, got {out_dtype}")
  (m, k), n = a_q.shape, b_q.shape[0]
  num_sms = num_sms or (4 if interpret else _num_sms())
  cfg = config or choose_config(m, n, k, num_sms)
  if n % cfg.cta_n:
    raise ValueError(f"fp8_gemm: N = {n} is not a multiple of the CTA width {cfg.cta_n} of {cfg}")
  row_scales = b_s.shape[0] == n
  if row_scales and cfg.cta_n * 4 < 128:  # B's scale row per ring slot must be >= 128 bytes (TMA alignment)
    cfg = dataclasses.replace(cfg, split="n")
  cfg = _fit_stages(cfg, out_dtype, row_scales)
  mp = -(-m // cfg.cta_m) * cfg.cta_m
  if mp != m:
    a_q = jnp.pad(a_q, ((0, mp - m), (0, 0)))
    a_s = jnp.pad(a_s, ((0, mp - m), (0, 0)))
  as_KbxMp = a_s.astype(jnp.float32).T
  if row_scales:
    bs = b_s.astype(jnp.float32).T  # (Kb, N)
  else:
    bs = jnp.repeat(b_s.astype(jnp.float32).T, _SCALE_REP, axis=1)  # (Kb, 32 * Nb)
  num_tiles = (mp // cfg.cta_m) * (n // cfg.cta_n)
  out_smem_type = plgpu.SMEM((NUM_COMPUTE_WGS, WG_M, cfg.wg_n), out_dtype,
                             transforms=_swizzled(cfg.wg_n * out_dtype.itemsize, out_dtype.itemsize))
  kernel = plgpu.kernel(
      functools.partial(_kernel, cfg=cfg, row_scales=row_scales),
      out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
      scratch_types=[out_smem_type],
      grid=(min(num_sms, num_tiles),),
      grid_names=("sm",),
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=False),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  out = kernel(a_q, b_q, as_KbxMp, bs)
  return out[:m] if mp != m else out
