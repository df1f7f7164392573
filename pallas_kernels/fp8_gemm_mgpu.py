"""Block-scaled FP8 GEMM ``C = A . B^T`` for Hopper (sm_90) in Pallas Mosaic GPU.

Operands and math are those of ``pallas_kernels.fp8_gemm`` (read its docstring): A E4M3 (M, K) with 1x128 FP32
scales (M, K/128); B E4M3 stored (N, K) (K-major, as FP8 wgmma needs) with either 128x128 tile scales
(ceil(N/128), K/128) [forward / dgrad] or 1x128 row scales (N, K/128) [wgrad].

Kernel structure (the DeepGEMM recipe, DeepSeek-V3 report sec. 3.3.2 "increasing accumulation precision", written
from scratch on the Pallas primitives; jax's ``hopper_matmul_mgpu.py`` shows the warp-specialized pattern):

1. Persistent grid: one CTA per SM walks the output tiles in a planar-snake order (``plgpu.planar_snake``), so
   CTAs that run at the same time share A rows / B columns in L2. With ``cross_tile`` the CTA runs one pipeline
   across all its tiles (``PipelinePipeline.START/STEADY/STOP``): the producer loads the next tile's first K blocks
   while the consumers finish this tile and write its epilogue.
2. Warp specialization: 2 or 3 consumer warpgroups and one producer warpgroup per CTA. The producer
   (``emit_pipeline_warp_specialized``) issues TMA copies of A (cta_m x 128*k_blocks), B (cta_n x 128*k_blocks) and
   the scale rows of each pipeline step into a ``max_concurrent_steps``-deep ring of 128B-swizzled SMEM buffers,
   and gives most registers to the consumers (``setmaxnreg``). With ``cluster_n`` two CTAs of a cluster compute
   side-by-side tiles and each A block is loaded once for both, multicast by TMA.
3. Each consumer warpgroup owns a 64 x wg_n block of C. Per 128-wide K block it (a) issues 4 FP8 wgmmas (k32 each)
   into a fresh zeroed FP32 wgmma accumulator, (b) reads the block's scales from SMEM while they run, (c) waits and
   promotes: ``acc + blk * (a_scale[m] * b_scale[n])`` in FP32 registers. With ``k_blocks=2`` a step issues both
   blocks' wgmmas into two accumulators first and promotes block 0 while block 1 still runs (``wgmma_wait(1)``).
   The tensor cores' FP8 accumulator keeps only ~14 mantissa bits, so promoting every 128 K values is what keeps the
   result at FP32 accuracy; and because each output element sees exactly the same promotion sequence in the same K
   order for every tile config, schedule, grid size and M, a row of C is bitwise the same whatever M is and wherever
   the row sits (batch invariance; tested bitwise on the GPU across M, row positions and 17 configs).
4. Epilogue: the FP32 accumulator is cast to the output dtype, stored to swizzled SMEM and written by TMA.

Tried and measured slower on the H200 (commit 3fae615, docs/benchmarks.md): carrying block 1's wgmma across the
pipeline step so that every promotion overlaps a wgmma (0.64-0.73x: ptxas reports C7514, "wgmma.mma_async
instructions are serialized due to non wgmma instructions reading accumulator registers of a wgmma between start and
end of the pipeline stage", once an accumulator stays in flight across the loop's back edge), and an epilogue
straight from registers to GMEM to free SMEM for a deeper ring (0.72-0.87x); and (commit b96e6b7) the two consumer
warpgroups taking turns to issue their wgmmas through a shared barrier, FA3-style ping-pong (0.69-0.78x); and
(commit f08a9a4) a hand-written pipeline with the K loop unrolled into chains, so that no wgmma is in flight across a
back edge: no C7514, but ptxas spills registers in most builds (0.28-0.61x), and the nearly spill-free builds run at
0.86-0.99x of this schedule.

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
# Tile scales are replicated 32x along N: 32 x f32 = 128 bytes, so that every slot of the scale ring in SMEM
# starts 128-byte aligned, as TMA (cp.async.bulk.tensor) requires of its SMEM destination.
_SCALE_REP = 32


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Tile shape and pipeline schedule of one kernel instance (speed only: every config gives the same bits).

  split: how the consumer warpgroups share the CTA tile: "m" -> CTA (64*num_wgs) x wg_n, "n" -> CTA 64 x 2*wg_n.
  num_wgs: consumer warpgroups, 2 or 3 (3 only with split "m": 192-row CTAs; registers allow one wgmma
    accumulator per K block then, so k_blocks must be 1).
  wg_n: columns of C per warpgroup (the wgmma N); divides 128 so that one B tile scale covers it.
  max_concurrent_steps: SMEM ring depth, in pipeline steps.
  grid_minor_dim / grid_tile_width: planar-snake tile order (L2 reuse).
  k_blocks: 128-wide K blocks per pipeline step, 1 or 2. With 2, block j+1's wgmmas run while block j is promoted
    (two wgmma accumulators) and there is one barrier round trip per 256 K values. Needs K/128 even (else 1 is used).
  cross_tile: run one pipeline across all output tiles of a CTA (``PipelinePipeline.START/STEADY/STOP``), so the
    producer loads the next tile's first blocks while this tile finishes and writes its epilogue. Used when every CTA
    has >= 2 tiles and the ring depth divides the K steps (the wrapper adjusts the depth, or drops it).
  cluster_n: run the CTAs in clusters of 2 that compute horizontally adjacent tiles (the same A rows); each A block
    is loaded once for both and multicast by TMA into both CTAs' SMEM (a quarter less L2 -> SM traffic). Needs an
    even number of CTA columns (else it is dropped).
  """

  split: str = "m"
  wg_n: int = 128
  max_concurrent_steps: int = 4
  grid_minor_dim: str = "n"
  grid_tile_width: int = 8
  k_blocks: int = 1
  cross_tile: bool = False
  num_wgs: int = 2
  cluster_n: bool = False

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
    if self.k_blocks not in (1, 2):
      raise ValueError(f"TuningConfig.k_blocks must be 1 or 2, got {self.k_blocks}")
    if self.num_wgs not in (2, 3) or (self.num_wgs == 3 and (self.split != "m" or self.k_blocks != 1)):
      raise ValueError(f"TuningConfig.num_wgs must be 2, or 3 with split='m' and k_blocks=1; got {self}")

  @property
  def cta_m(self) -> int:
    return WG_M * (self.num_wgs if self.split == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.wg_n * (self.num_wgs if self.split == "n" else 1)

  @property
  def cluster_size(self) -> int:
    """CTAs per cluster (side by side along N)."""
    return 2 if self.cluster_n else 1


def _num_sms() -> int:
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return 132
  return getattr(dev, "core_count", 0) or 132


def choose_config(m: int, n: int, k: int, num_sms: int | None = None, row_scales: bool = False) -> TuningConfig:
  """Tile config per shape class (decode: small M, prefill/training: large M).

  Every config computes each output element with the same instruction sequence (module docstring, item 3), so the
  choice changes speed, never bits (the GPU tests check configs bitwise). Measured on the H200 (docs/benchmarks.md,
  "Schedule experiments"):
  * M >= 2048 and N >= 16384 (gate_up, lm_head): 192x128 CTAs with three consumer warpgroups (gate_up 1303 TFLOP/s
    vs 1224 for 128x128); for N = 4096 / 6144 they lose (o 1064 vs 1176), so those keep 128x128.
  * M >= 2048: CTAs in pairs along N that share A by TMA multicast (``cluster_n``), and one pipeline across a CTA's
    tiles: +1-3% (M = 8192: qkv 1207 vs 1192, o 1187 vs 1174, gate_up 1312 vs 1292, lm_head 1223 vs 1189). Not for
    wgrad (``row_scales``), where clusters lose 4-6% (o dW 883 vs 942, gate_up dW 921 vs 964).
  * Otherwise two K blocks per pipeline step and one pipeline across a CTA's tiles (each falls back when the shape
    does not allow it), and the largest CTA tile whose grid still fills ~70% of the SMs: 128x128 for training and
    M ~ 256 with N >= 6144 (qkv at M = 256: 602 vs 522 for 64x128), then 64-row CTAs narrowed over N for decode,
    where the GEMM is bound by reading B (M = 256 o/down: 64x128; M = 64 qkv: 64x64, o/down: 64x32).
  """
  del k
  big = m >= 2048
  if big and n >= 16384 and not row_scales:
    return TuningConfig("m", 128, 4, num_wgs=3, cross_tile=True, cluster_n=True)
  num_sms = num_sms or _num_sms()
  enough = (7 * num_sms) // 10
  T = functools.partial(TuningConfig, k_blocks=2, cross_tile=True, cluster_n=big and not row_scales)
  cands = [T("m", 128, 2)] if m > WG_M else []
  cands += [T("n", 64, 4), T("n", 32, 4), T("n", 16, 4)]
  for cfg in cands:
    if n % cfg.cta_n == 0 and -(-m // cfg.cta_m) * (n // cfg.cta_n) >= enough:
      return cfg
  return cands[-1]


_SMEM_BUDGET = 220 * 1024  # of the 227 KiB an sm_90 CTA may use; the rest is left for barriers.


def _plan(cfg: TuningConfig, m: int, n: int, k: int, out_dtype, row_scales: bool, num_sms: int):
  """Resolves a config for one shape: k_blocks, ring depth (SMEM fit; divides the K steps for cross_tile), grid.

  Returns (cfg as it will run, padded M, grid size in clusters (= CTAs without cluster_n)).
  """
  if (k // BLOCK) % cfg.k_blocks:
    cfg = dataclasses.replace(cfg, k_blocks=1)
  kb = cfg.k_blocks
  bs_cols = cfg.cta_n if row_scales else _SCALE_REP * max(1, cfg.cta_n // BLOCK)
  stage = kb * ((cfg.cta_m + cfg.cta_n) * BLOCK + 4 * (cfg.cta_m + bs_cols))
  out = cfg.num_wgs * WG_M * cfg.wg_n * jnp.dtype(out_dtype).itemsize
  k_steps = k // (BLOCK * kb)
  stages = max(2, min(cfg.max_concurrent_steps, (_SMEM_BUDGET - out) // stage, k_steps))
  mp = -(-m // cfg.cta_m) * cfg.cta_m
  if cfg.cluster_n and (n // cfg.cta_n) % cfg.cluster_size:
    cfg = dataclasses.replace(cfg, cluster_n=False)
  c = cfg.cluster_size
  num_tiles = (mp // cfg.cta_m) * (n // cfg.cta_n) // c  # in clusters
  grid = min(num_sms // c, num_tiles)  # in clusters
  cross = cfg.cross_tile and num_tiles >= 2 * grid
  if cross:
    while stages > 2 and k_steps % stages:
      stages -= 1
    cross = k_steps % stages == 0
  return dataclasses.replace(cfg, max_concurrent_steps=stages, cross_tile=cross), mp, grid


def _swizzled(shape_minor_bytes: int, itemsize: int):
  swizzle = plgpu.find_swizzle(shape_minor_bytes * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel(a_gmem, b_gmem, as_gmem, bs_gmem, out_gmem, out_smem, *, cfg: TuningConfig, row_scales: bool):
  """Refs: a (Mp, K) e4m3, b (N, K) e4m3, as (Kb, Mp) f32, bs (Kb, 32*Nb | N) f32, out (Mp, N)."""
  mp, k = a_gmem.shape
  n = b_gmem.shape[0]
  out_dtype = out_gmem.dtype
  cta_m, cta_n, wg_n, kb = cfg.cta_m, cfg.cta_n, cfg.wg_n, cfg.k_blocks
  m_iters, n_iters, k_steps = mp // cta_m, n // (cta_n * cfg.cluster_size), k // (BLOCK * kb)
  fp8_transforms = _swizzled(BLOCK, 1)  # 128 B rows -> 128 B swizzle
  # Columns of bs a CTA needs: its own (row scales) or the replicated scale of each 128-wide block it touches.
  bs_cols = cta_n if row_scales else _SCALE_REP * max(1, cta_n // BLOCK)

  def get_pipeline(body, compute_context, pipeline_state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40 if cfg.num_wgs == 2 else 32,  # 3 consumers: (512 - 32) / 3 -> 160 registers each
        in_specs=[
            plgpu.BlockSpec((cta_m, kb * BLOCK), lambda kk: (0, kk), transforms=fp8_transforms,
                            memory_space=plgpu.SMEM, collective_axes=("cluster",) if cfg.cluster_n else ()),
            plgpu.BlockSpec((cta_n, kb * BLOCK), lambda kk: (0, kk), transforms=fp8_transforms,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((kb, cta_m), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
            plgpu.BlockSpec((kb, bs_cols), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=cfg.num_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
        pipeline_state=pipeline_state,
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
      if cfg.cluster_n:  # the walk is over cluster tiles; this CTA takes its half
        n_idx = n_idx * cfg.cluster_size + lax.axis_index("cluster")
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
      pipeline_state = None
      if cfg.cross_tile:  # every CTA has >= 2 tiles (_plan keeps it only then)
        P = plgpu.PipelinePipeline
        pipeline_state = jnp.where(info.local_index == 0, int(P.START),
                                   jnp.where(info.local_index == info.num_local_steps - 1, int(P.STOP),
                                             int(P.STEADY)))

      def operands(a_smem, b_smem, j):
        """This warpgroup's A (64 x 128) and B^T (128 x wg_n) views of K block j of the step."""
        a = a_smem.at[pl.ds(wg_m_off, WG_M)]
        b = b_smem.at[pl.ds(wg_n_off, wg_n)]
        if kb > 1:
          a, b = a.at[:, pl.ds(j * BLOCK, BLOCK)], b.at[:, pl.ds(j * BLOCK, BLOCK)]
        return a, b.transpose((1, 0))

      def scales(as_smem, bs_smem, j):
        sa = plgpu.load(as_smem.at[j, pl.ds(wg_m_off, WG_M)], layout=plgpu.Layout.WGMMA.reduce(1))
        if row_scales:
          sb = plgpu.load(bs_smem.at[j, pl.ds(bs_col, wg_n)], layout=plgpu.Layout.WGMMA.reduce(0))
        else:
          sb = bs_smem[j, bs_col]
        return sa, sb

      def promote(acc, blk, sa, sb):
        """(3) FP32 promotion of one K block: acc + blk * (a_scale[m] * b_scale[n]); the same code for all configs."""
        if row_scales:
          scale = (lax.broadcast_in_dim(sa, (WG_M, wg_n), [0])
                   * lax.broadcast_in_dim(sb, (WG_M, wg_n), [1]))
        else:
          scale = lax.broadcast_in_dim(sa * sb, (WG_M, wg_n), [0])
        return acc + blk * scale

      def zeros():
        return plgpu.layout_cast(jnp.zeros((WG_M, wg_n), jnp.float32), plgpu.Layout.WGMMA)

      def epilogue(acc):
        """(4) registers -> swizzled SMEM -> TMA store (overlaps the next tile's main loop)."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg], out_gmem.at[pl.ds(m0 + wg_m_off, WG_M), pl.ds(n0 + wg_n_off, wg_n)])

      def compute_context(eval_pipeline):
        epilogue(eval_pipeline(zeros()))

      def mma_body(_, a_smem, b_smem, as_smem, bs_smem, acc):
        def block_dots(*blk_refs):
          for j, r in enumerate(blk_refs):
            plgpu.wgmma(r, *operands(a_smem, b_smem, j))
          out = acc
          for j, r in enumerate(blk_refs):  # scale loads overlap the wgmmas in flight
            s = scales(as_smem, bs_smem, j)
            # Block j is promoted while blocks j+1.. still run on the tensor cores.
            out = promote(out, plgpu.wgmma_accumulator_load(r, wait_n=kb - 1 - j), *s)
          return out

        # A fresh (zeroed) FP8 wgmma accumulator per K block.
        return pl.run_scoped(block_dots, *([plgpu.ACC((WG_M, wg_n), jnp.float32)] * kb))

      get_pipeline(mma_body, compute_context, pipeline_state)(
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
  row_scales = b_s.shape[0] == n
  cfg = config or choose_config(m, n, k, num_sms, row_scales)
  if n % cfg.cta_n:
    raise ValueError(f"fp8_gemm: N = {n} is not a multiple of the CTA width {cfg.cta_n} of {cfg}")
  if row_scales and cfg.cta_n * 4 < 128:  # B's scale row per ring slot must be >= 128 bytes (TMA alignment)
    cfg = dataclasses.replace(cfg, split="n")
  if interpret:
    # jax 0.11.2's GPU interpreter deadlocks on some cross-tile pipelines (always, e.g. with 64x128 CTAs: the
    # producer never arrives) and now and then with 3 consumer warpgroups (about every other run of a 200x256x256
    # case on 2 CPU cores). The H200 runs both bitwise equal to the 2-warpgroup, per-tile pipeline (GPU tests), so
    # the interpreter runs that: the same bits.
    cfg = dataclasses.replace(cfg, cross_tile=False)
    if cfg.num_wgs == 3:
      cfg = dataclasses.replace(cfg, num_wgs=2)
  cfg, mp, grid = _plan(cfg, m, n, k, out_dtype, row_scales, num_sms)
  if mp != m:
    a_q = jnp.pad(a_q, ((0, mp - m), (0, 0)))
    a_s = jnp.pad(a_s, ((0, mp - m), (0, 0)))
  as_KbxMp = a_s.astype(jnp.float32).T
  if row_scales:
    bs = b_s.astype(jnp.float32).T  # (Kb, N)
  else:
    bs = jnp.repeat(b_s.astype(jnp.float32).T, _SCALE_REP, axis=1)  # (Kb, 32 * Nb)
  out_smem_type = plgpu.SMEM((cfg.num_wgs, WG_M, cfg.wg_n), out_dtype,
                             transforms=_swizzled(cfg.wg_n * out_dtype.itemsize, out_dtype.itemsize))
  kernel = plgpu.kernel(
      functools.partial(_kernel, cfg=cfg, row_scales=row_scales),
      out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
      scratch_types=[out_smem_type],
      grid=(grid,),
      grid_names=("sm",),
      **(dict(cluster=(cfg.cluster_size,), cluster_names=("cluster",)) if cfg.cluster_n else {}),
      num_threads=cfg.num_wgs + 1,
      thread_name="wg",
      kernel_name="fp8jax_fp8_gemm",  # what profilers (ncu, CUPTI) show
      compiler_params=plgpu.CompilerParams(approx_math=False),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  out = kernel(a_q, b_q, as_KbxMp, bs)
  return out[:m] if mp != m else out
