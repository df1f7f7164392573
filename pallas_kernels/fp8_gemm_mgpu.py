"""Block-scaled FP8 and BF16 GEMMs ``C = A . B^T`` for Hopper (sm_90) in Pallas Mosaic GPU: one kernel, two modes.

Operands and math are those of ``pallas_kernels.fp8_gemm`` (read its docstring):
* ``fp8_gemm``: A E4M3 (M, K) with 1x128 FP32 scales (M, K/128); B E4M3 stored (N, K) (K-major, as FP8 wgmma needs)
  with either 128x128 tile scales (ceil(N/128), K/128) [forward / dgrad] or 1x128 row scales (N, K/128) [wgrad].
* ``grouped_fp8_gemm`` (mixture of experts): ``fp8_gemm``'s forward / dgrad operands with B stacked over experts,
  (E, N, K) + tile scales (E, N/128, K/128), and A's rows in ``grouped_gemm``'s tile layout (each 128-row tile of
  A belongs to one expert); each tile's B loads start at its expert. Reference ``grouped_gemm_reference``.
* ``bf16_gemm``: A BF16 (M, K), B BF16 stored (N, K) (the K-major transposed SMEM view, as in FP8 mode), FP32
  accumulation; reference ``fp8_gemm.bf16_gemm_reference``. The BF16 linears and the lm_head of ``fp8jax.ops``.
  ``grouped_bf16_gemm_tiles``: its grouped mode (B stacked (E, N, K), A in the tile layout), the BF16 experts.
* ``grouped_fp8_wgrad_tiles`` / ``grouped_bf16_wgrad_tiles`` (the experts' weight gradients): the wgrad mode (FP8
  with row scales, or BF16) where K is the tile buffer's tokens and expert e's output block contracts only over its
  own 128-token tiles; one pipeline per CTA over all its output tiles' steps (a step table built in the wrapper).
  Reference ``grouped_gemm.grouped_wgrad_tiles`` (FP8) / ``dot_tiles_wgrad_by_tile`` (BF16).

Kernel structure (the DeepGEMM recipe, DeepSeek-V3 report sec. 3.3.2 "increasing accumulation precision", written
from scratch on the Pallas primitives; jax's ``hopper_matmul_mgpu.py`` shows the warp-specialized pattern):

1. Persistent grid: one CTA per SM walks the output tiles in a planar-snake order (``plgpu.planar_snake``), so
   CTAs that run at the same time share A rows / B columns in L2. With ``cross_tile`` the CTA runs one pipeline
   across all its tiles (``PipelinePipeline.START/STEADY/STOP``): the producer loads the next tile's first K blocks
   while the consumers finish this tile and write its epilogue.
2. Warp specialization: 2 or 3 consumer warpgroups and one producer warpgroup per CTA. The producer
   (``emit_pipeline_warp_specialized``) issues TMA copies of A (cta_m x k_blocks K blocks of 128 bytes), B (cta_n x
   the same) and, in FP8 mode, the scale rows of each pipeline step into a ``max_concurrent_steps``-deep ring of
   128B-swizzled SMEM buffers, and gives most registers to the consumers (``setmaxnreg``). With ``cluster_n`` two
   CTAs of a cluster compute side-by-side tiles and each A block is loaded once for both, multicast by TMA.
3. Each consumer warpgroup owns a 64 x wg_n block of C. Per 128-wide K block it (a) issues 4 FP8 wgmmas (k32 each)
   into a fresh zeroed FP32 wgmma accumulator, (b) reads the block's scales from SMEM while they run, (c) waits and
   promotes: ``acc + blk * (a_scale[m] * b_scale[n])`` in FP32 registers. With ``k_blocks=2`` a step issues both
   blocks' wgmmas into two accumulators first and promotes block 0 while block 1 still runs (``wgmma_wait(1)``).
   The tensor cores' FP8 accumulator keeps only ~14 mantissa bits, so promoting every 128 K values is what keeps the
   result at FP32 accuracy; and because each output element sees exactly the same promotion sequence in the same K
   order for every tile config, schedule, grid size and M, a row of C is bitwise the same whatever M is and wherever
   the row sits (batch invariance; tested bitwise on the GPU across M, row positions and 17 configs).
3b. BF16 mode has no scales and no promotion: BF16 wgmma accumulates into an FP32 accumulator (not FP8's narrow
   one), so each consumer warpgroup allocates one zeroed FP32 wgmma accumulator per output tile and every K block
   (64 BF16 values, one 128-byte swizzle row) adds into it: its 4 k16 wgmmas are issued in increasing K order, then
   waited on before the ring slot goes back to the producer. Invariance contract (as in FP8 mode): each output
   element C[m, n] is the result of the same chain of K/16 wgmma accumulation steps over row m of A and row n of B,
   from zero, in increasing K order; never split over K, and the same for every M, position of the row in A, tile
   config (CTA shape, wg_n, k_blocks, ring depth, warpgroups, clusters, cross_tile) and grid, since those change only
   which warpgroup issues the chain and when. Zero padding rows only add rows. So a row of C is bitwise the same
   whatever M is (this relies, as FP8 mode does, on a wgmma computing an element the same way whatever its N and the
   element's place in the tile; tested bitwise on the GPU across M and the shipped configs).
4. Epilogue: the FP32 accumulator is cast to the output dtype, stored to swizzled SMEM and written by TMA.

Tried and measured slower on the H200 (commit 3fae615, docs/history.md): carrying block 1's wgmma across the
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
of 128 (a ValueError otherwise). Tile configs per shape class: ``choose_config`` (FP8), ``choose_bf16_config``.
Measured figures: docs/performance.md, "FP8 GEMM vs cuBLAS"; what limits them: docs/history.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import grouped_gemm
from pallas_kernels.fp8_gemm import BLOCK, check_operands, num_blocks

WG_M = 64  # rows of C per consumer warpgroup: one m64 wgmma row block.
# Tile scales are replicated 32x along N: 32 x f32 = 128 bytes, so that every slot of the scale ring in SMEM
# starts 128-byte aligned, as TMA (cp.async.bulk.tensor) requires of its SMEM destination.
_SCALE_REP = 32
# A K block is one 128-byte row of the SMEM ring (one 128-byte swizzle span): 128 E4M3 values (one scale group in
# FP8 mode) or 64 BF16 values. A ring stage then costs the same SMEM per K block in both modes.
_K_BLOCK_BYTES = 128


def _block_k(dtype) -> int:
  """K values per K block of an operand dtype (E4M3: 128 = BLOCK, BF16: 64)."""
  return _K_BLOCK_BYTES // jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class TuningConfig:
  """Tile shape and pipeline schedule of one kernel instance (speed only: every config gives the same bits).

  split: how the consumer warpgroups share the CTA tile: "m" -> CTA (64*num_wgs) x wg_n, "n" -> CTA 64 x 2*wg_n.
  num_wgs: consumer warpgroups, 2 or 3 (3 only with split "m": 192-row CTAs; registers allow one wgmma
    accumulator per K block then, so k_blocks must be 1).
  wg_n: columns of C per warpgroup (the wgmma N); divides 128 so that one B tile scale covers it.
  max_concurrent_steps: SMEM ring depth, in pipeline steps.
  grid_minor_dim / grid_tile_width: planar-snake tile order (L2 reuse).
  k_blocks: K blocks per pipeline step, 1 or 2 (a K block is 128 E4M3 or 64 BF16 values). FP8: with 2, block j+1's
    wgmmas run while block j is promoted (two wgmma accumulators). Both modes: one barrier round trip per step.
    Needs an even number of K blocks (else 1 is used).
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
    dev = jax.local_devices()[0]
  except RuntimeError:
    return 132
  return getattr(dev, "core_count", 0) or 132


def choose_config(m: int, n: int, k: int, num_sms: int | None = None, row_scales: bool = False) -> TuningConfig:
  """Tile config per shape class (decode: small M, prefill/training: large M).

  Every config computes each output element with the same instruction sequence (module docstring, item 3), so the
  choice changes speed, never bits (the GPU tests check configs bitwise). Measured on the H200 (docs/history.md,
  "Tried and dropped"):
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
  T = functools.partial(TuningConfig, k_blocks=2, cross_tile=True, cluster_n=big and not row_scales)
  return _largest_filling(([T("m", 128, 2)] if m > WG_M else []) + [T("n", w, 4) for w in (64, 32, 16)],
                          m, n, num_sms)


def choose_bf16_config(m: int, n: int, k: int, num_sms: int | None = None, out_dtype=jnp.bfloat16) -> TuningConfig:
  """Tile config of ``bf16_gemm`` per shape class (lm_head: N = 128256 / 32768; the Llama-3.1-8B linears).

  As in FP8 mode every config gives the same bits (module docstring, item 3b). Decode-sized M with BF16 outputs is
  tuned on the H200 (below); the rest are the FP8 forward's tile shapes (the same reasons hold: large-M tiles for the tensor cores, and for decode the
  largest CTA whose grid fills ~70% of the SMs, since reading B bounds it) with these changes, from the SMEM
  arithmetic of ``_plan``:
  * one K block (64 values) per step and a deeper ring: there is no promotion for a second block's wgmmas to
    overlap, and a 64 x K-block ring stage is small (24 KiB for a 64x128 CTA), so decode CTAs keep up to 8 stages
    of B loads in flight;
  * the 3-warpgroup 192x128 tile only for BF16 outputs: with FP32 outputs (the lm_head) its 96 KiB of output staging
    would leave a 2-deep ring, so those get 128x128 with 4 stages.
  ``scripts/bench_gemm.py --bf16 --variants`` times these against the alternatives.
  """
  del k
  big = m >= 2048
  bf16_out = jnp.dtype(out_dtype).itemsize == 2
  if big and n >= 16384 and bf16_out:
    return TuningConfig("m", 128, 4, num_wgs=3, cross_tile=True, cluster_n=True)
  T = functools.partial(TuningConfig, cross_tile=True, cluster_n=big)
  if WG_M < m < 2048 and bf16_out:
    # Decode-sized M with BF16 out: a 5-deep ring of 128 x 128, else 128 x 64 CTAs 8 deep when 128 x 128 leaves SMs
    # idle (N = 4096: o, down), no cross-tile pipeline: the fastest of `bench_gemm.py --bf16 --variants` at M = 256
    # on the H200 for every 8B linear (docs/performance.md, "FP8 GEMM vs cuBLAS").
    lead = [TuningConfig("m", 128, 5), TuningConfig("m", 64, 8)]
  else:
    lead = [T("m", 128, 4)] if m > WG_M else []
  return _largest_filling(lead + [T("n", w, 8) for w in (64, 32, 16)], m, n, num_sms)


def _largest_filling(cands: list[TuningConfig], m: int, n: int, num_sms: int | None) -> TuningConfig:
  """The first of ``cands`` (largest CTA first) that tiles N and whose grid fills ~70% of the SMs, else the last."""
  enough = (7 * (num_sms or _num_sms())) // 10
  for cfg in cands:
    if n % cfg.cta_n == 0 and -(-m // cfg.cta_m) * (n // cfg.cta_n) >= enough:
      return cfg
  return cands[-1]


_SMEM_BUDGET = 220 * 1024  # of the 227 KiB an sm_90 CTA may use; the rest is left for barriers.


def _plan(cfg: TuningConfig, m: int, n: int, k: int, out_dtype, row_scales: bool, num_sms: int,
          in_dtype=jnp.float8_e4m3fn):
  """Resolves a config for one shape: k_blocks, ring depth (SMEM fit; divides the K steps for cross_tile), grid.

  ``in_dtype`` is the operands' dtype: E4M3 (FP8 mode, with scale rows in the ring) or BF16 (no scales).
  Returns (cfg as it will run, padded M, grid size in clusters (= CTAs without cluster_n)).
  """
  bk = _block_k(in_dtype)
  if (k // bk) % cfg.k_blocks:
    cfg = dataclasses.replace(cfg, k_blocks=1)
  kb = cfg.k_blocks
  scale_bytes = 0
  if jnp.dtype(in_dtype).itemsize == 1:  # FP8 mode: a scale row of A and of B per K block
    scale_bytes = 4 * (cfg.cta_m + (cfg.cta_n if row_scales else _SCALE_REP * max(1, cfg.cta_n // BLOCK)))
  stage = kb * ((cfg.cta_m + cfg.cta_n) * _K_BLOCK_BYTES + scale_bytes)
  out = cfg.num_wgs * WG_M * cfg.wg_n * jnp.dtype(out_dtype).itemsize
  k_steps = k // (bk * kb)
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


def _kernel(*refs, cfg: TuningConfig, row_scales: bool, num_experts: int = 0):
  """Refs: a (Mp, K), b (N, K), [as (Kb, Mp) f32, bs (Kb, 32*Nb | N) f32,] [tile_expert (Mp/128,) i32,] out (Mp, N),
  out_smem.

  With the two scale refs: FP8 mode (E4M3 operands, a fresh wgmma accumulator per K block, FP32 promotion).
  Without: BF16 mode (BF16 operands, one wgmma accumulator over all of K, no promotion).
  With ``num_experts`` (grouped mode; FP8 with tile scales, or BF16): b is the experts' weights stacked (E*N, K), bs
  (FP8) their replicated tile scales side by side (Kb, E*32*Nb), and the last input maps each 128-row tile of A to
  its expert; a tile's B (and B-scale) loads start at its expert's block, everything else is the dense kernel.
  """
  *in_gmem, out_gmem, out_smem = refs
  if num_experts:
    *in_gmem, tile_expert_gmem = in_gmem
  a_gmem, b_gmem, *scale_gmem = in_gmem
  scaled = bool(scale_gmem)
  mp, k = a_gmem.shape
  n = out_gmem.shape[1]
  out_dtype = out_gmem.dtype
  cta_m, cta_n, wg_n, kb = cfg.cta_m, cfg.cta_n, cfg.wg_n, cfg.k_blocks
  bk = _block_k(a_gmem.dtype)
  m_iters, n_iters, k_steps = mp // cta_m, n // (cta_n * cfg.cluster_size), k // (bk * kb)
  transforms = _swizzled(_K_BLOCK_BYTES, a_gmem.dtype.itemsize)  # 128 B rows -> 128 B swizzle
  # Columns of bs a CTA needs: its own (row scales) or the replicated scale of each 128-wide block it touches.
  bs_cols = cta_n if row_scales else _SCALE_REP * max(1, cta_n // BLOCK)

  def get_pipeline(body, compute_context, pipeline_state=None):
    specs = [
        plgpu.BlockSpec((cta_m, kb * bk), lambda kk: (0, kk), transforms=transforms,
                        memory_space=plgpu.SMEM, collective_axes=("cluster",) if cfg.cluster_n else ()),
        plgpu.BlockSpec((cta_n, kb * bk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
    ]
    if scaled:
      specs += [plgpu.BlockSpec((kb, cta_m), lambda kk: (kk, 0), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((kb, bs_cols), lambda kk: (kk, 0), memory_space=plgpu.SMEM)]
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40 if cfg.num_wgs == 2 else 32,  # 3 consumers: (512 - 32) / 3 -> 160 registers each
        in_specs=specs,
        wg_axis="wg",
        num_compute_wgs=cfg.num_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
        pipeline_state=pipeline_state,
    )

  ignore = lambda *_, **__: None
  first_tile = [a_gmem.at[pl.ds(0, cta_m)], b_gmem.at[pl.ds(0, cta_n)]]
  if scaled:
    first_tile += [scale_gmem[0].at[:, pl.ds(0, cta_m)], scale_gmem[1].at[:, pl.ds(0, bs_cols)]]

  @functools.partial(
      pl.run_scoped,
      allocs=get_pipeline(ignore, ignore).get_allocations(*first_tile),
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
      b_row0 = n0
      if num_experts:  # grouped mode: the tile's expert (ids >= E: an unused tile, all zero rows)
        tile_id = tile_expert_gmem[lax.div(m0, BLOCK)]
        expert = jnp.minimum(tile_id, num_experts - 1)
        b_row0 = expert * n + n0
      if cfg.split == "m":
        wg_m_off, wg_n_off = wg * WG_M, 0
      else:
        wg_m_off, wg_n_off = 0, wg * wg_n
      pipeline_state = None
      if cfg.cross_tile:  # every CTA has >= 2 tiles (_plan keeps it only then)
        P = plgpu.PipelinePipeline
        pipeline_state = jnp.where(info.local_index == 0, int(P.START),
                                   jnp.where(info.local_index == info.num_local_steps - 1, int(P.STOP),
                                             int(P.STEADY)))

      def operands(a_smem, b_smem, j):
        """This warpgroup's A (64 x bk) and B^T (bk x wg_n) views of K block j of the step."""
        a = a_smem.at[pl.ds(wg_m_off, WG_M)]
        b = b_smem.at[pl.ds(wg_n_off, wg_n)]
        if kb > 1:
          a, b = a.at[:, pl.ds(j * bk, bk)], b.at[:, pl.ds(j * bk, bk)]
        return a, b.transpose((1, 0))

      def epilogue(acc):
        """(4) registers -> swizzled SMEM -> TMA store (overlaps the next tile's main loop)."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg], out_gmem.at[pl.ds(m0 + wg_m_off, WG_M), pl.ds(n0 + wg_n_off, wg_n)])

      tile_gmem = [a_gmem.at[pl.ds(m0, cta_m)], b_gmem.at[pl.ds(b_row0, cta_n)]]
      if scaled:
        body, compute_context, scale_tile = _fp8_step(operands, epilogue, cfg, row_scales, n0, wg_m_off, wg_n_off)
        if num_experts:
          scale_tile = scale_tile + expert * (_SCALE_REP * (n // BLOCK))
        tile_gmem += [scale_gmem[0].at[:, pl.ds(m0, cta_m)], scale_gmem[1].at[:, pl.ds(scale_tile, bs_cols)]]
      else:
        body, compute_context = _bf16_step(operands, epilogue, cfg)
      run_tile = lambda: get_pipeline(body, compute_context, pipeline_state)(*tile_gmem, allocations=allocs)
      if num_experts and not cfg.cross_tile:
        # Grouped mode, one pipeline per tile: unused tiles are skipped (their rows of C are left unwritten).
        # Across tiles the pipeline's START/STOP steps need every tile, so there they run (with zero rows: zeros).
        pl.when(tile_id < num_experts)(run_tile)
      else:
        run_tile()

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _fp8_step(operands, epilogue, cfg: TuningConfig, row_scales: bool, n0, wg_m_off, wg_n_off):
  """FP8 mode's pipeline body and compute context (module docstring, item 3), and the first bs column of the tile."""
  wg_n, kb = cfg.wg_n, cfg.k_blocks
  if row_scales:
    bs_start = n0
    bs_col = wg_n_off
  else:
    nb0 = n0 // BLOCK
    bs_start = nb0 * _SCALE_REP
    bs_col = ((n0 + wg_n_off) // BLOCK - nb0) * _SCALE_REP

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

  def compute_context(eval_pipeline):
    epilogue(eval_pipeline(plgpu.layout_cast(jnp.zeros((WG_M, wg_n), jnp.float32), plgpu.Layout.WGMMA)))

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

  return mma_body, compute_context, bs_start


def _bf16_step(operands, epilogue, cfg: TuningConfig):
  """BF16 mode's pipeline body and compute context (module docstring, item 3b)."""

  def compute_context(eval_pipeline):
    # One FP32 wgmma accumulator for the whole tile, zeroed when allocated: every K block adds into it in order.
    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((WG_M, cfg.wg_n), jnp.float32))
    def _acc_scope(acc_ref):
      epilogue(eval_pipeline(acc_ref)[...])

  def mma_body(_, a_smem, b_smem, acc_ref):
    for j in range(cfg.k_blocks):
      plgpu.wgmma(acc_ref, *operands(a_smem, b_smem, j))
    # The step's SMEM slot goes back to the producer when the body returns, so its wgmmas must have read it.
    plgpu.wgmma_wait(0)
    return acc_ref

  return mma_body, compute_context


def _validate(a_q, a_s, b_q, b_s):
  check_operands(a_q, a_s, b_q, b_s)
  n = b_q.shape[0]
  if n % BLOCK:
    raise ValueError(f"fp8_gemm (Mosaic GPU): N = {n} (B {tuple(b_q.shape)}) must be a multiple of {BLOCK}")
  if a_q.shape[0] == 0:
    raise ValueError(f"fp8_gemm (Mosaic GPU): M must be >= 1, got A {tuple(a_q.shape)}")


def _out_dtype(out_dtype, op: str):
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"{op} (Mosaic GPU): out_dtype must be bfloat16 or float32, got {out_dtype}")
  return out_dtype


def _resolve(cfg: TuningConfig, m: int, n: int, k: int, out_dtype, row_scales: bool, num_sms: int, interpret: bool,
             in_dtype, op: str):
  """A requested or chosen config -> (cfg as it will run, padded M, grid): checks, interpreter limits, ``_plan``."""
  if n % cfg.cta_n:
    raise ValueError(f"{op}: N = {n} is not a multiple of the CTA width {cfg.cta_n} of {cfg}")
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
  return _plan(cfg, m, n, k, out_dtype, row_scales, num_sms, in_dtype)


def _launch(*operands, cfg: TuningConfig, row_scales: bool, mp: int, n: int, out_dtype, grid: int, interpret: bool,
            kernel_name: str, num_experts: int = 0):
  """Runs ``_kernel`` on (Mp, .) operands -> (Mp, N) ``out_dtype``."""
  out_smem_type = plgpu.SMEM((cfg.num_wgs, WG_M, cfg.wg_n), out_dtype,
                             transforms=_swizzled(cfg.wg_n * out_dtype.itemsize, out_dtype.itemsize))
  kernel = plgpu.kernel(
      functools.partial(_kernel, cfg=cfg, row_scales=row_scales, num_experts=num_experts),
      out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
      scratch_types=[out_smem_type],
      grid=(grid,),
      grid_names=("sm",),
      **(dict(cluster=(cfg.cluster_size,), cluster_names=("cluster",)) if cfg.cluster_n else {}),
      num_threads=cfg.num_wgs + 1,
      thread_name="wg",
      kernel_name=kernel_name,  # what profilers (ncu, CUPTI) show
      compiler_params=plgpu.CompilerParams(approx_math=False),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return kernel(*operands)


def _pad_rows(x, mp: int):
  return jnp.pad(x, ((0, mp - x.shape[0]), (0, 0))) if mp != x.shape[0] else x


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "num_sms", "a_scales_t"))
def fp8_gemm(a_q, a_s, b_q, b_s, *, out_dtype=jnp.bfloat16, config: TuningConfig | None = None,
             interpret: bool = False, num_sms: int | None = None, a_scales_t: bool = False, b_scales_kernel=None):
  """C = A . B^T with block-scaled E4M3 operands (layouts in the module docstring); returns (M, N) ``out_dtype``.

  The scales in the layouts the kernel reads, when the caller has them (same values, so the same bits; otherwise the
  wrapper lays them out, two small XLA ops per call, which XLA does not hoist out of a loop):
  ``a_scales_t``: ``a_s`` is (K/128, M) (``fp8_quant.quantize_act(scales_t=True)`` writes it);
  ``b_scales_kernel``: ``kernel_b_scales(b_s)``, made once for weights that serve many calls (the sampler's decode
  loop; ``fp8jax.ops.with_kernel_scales``); ``b_s`` is then only checked."""
  a_s_MxKb = jax.ShapeDtypeStruct(a_s.shape[::-1], a_s.dtype) if a_scales_t else a_s
  _validate(a_q, a_s_MxKb, b_q, b_s)
  out_dtype = _out_dtype(out_dtype, "fp8_gemm")
  (m, k), n = a_q.shape, b_q.shape[0]
  num_sms = num_sms or (4 if interpret else _num_sms())
  row_scales = b_s.shape[0] == n
  cfg, mp, grid = _resolve(config or choose_config(m, n, k, num_sms, row_scales), m, n, k, out_dtype, row_scales,
                           num_sms, interpret, a_q.dtype, "fp8_gemm")
  if a_scales_t:
    as_KbxMp = jnp.pad(a_s.astype(jnp.float32), ((0, 0), (0, mp - m)))
  else:
    as_KbxMp = _pad_rows(a_s, mp).astype(jnp.float32).T
  if b_scales_kernel is None:
    bs = b_s.astype(jnp.float32).T if row_scales else kernel_b_scales(b_s)  # (Kb, N) | (Kb, 32 * Nb)
  elif row_scales or b_scales_kernel.shape != (b_s.shape[1], _SCALE_REP * b_s.shape[0]):
    raise ValueError(f"fp8_gemm: b_scales_kernel {tuple(b_scales_kernel.shape)} is not kernel_b_scales of the tile "
                     f"scales {tuple(b_s.shape)}")
  else:
    bs = b_scales_kernel
  out = _launch(_pad_rows(a_q, mp), b_q, as_KbxMp, bs, cfg=cfg, row_scales=row_scales, mp=mp, n=n,
                out_dtype=out_dtype, grid=grid, interpret=interpret, kernel_name="fp8jax_fp8_gemm")
  return out[:m] if mp != m else out


def kernel_b_scales(b_s_NbxKb):
  """B's 128x128 tile scales (N/128, K/128) in the layout the kernel reads: (K/128, 32 * N/128) FP32, transposed and
  each scale 32 times (one 128-byte TMA box per 128-column block)."""
  return _replicate(b_s_NbxKb.T)


def _replicate(bs_KbxC):
  """Tile scales (Kb, C) -> (Kb, 32*C) f32: each scale 32 times (one 128-byte TMA box per 128-column block)."""
  return jnp.repeat(bs_KbxC.astype(jnp.float32), _SCALE_REP, axis=1)


def _validate_grouped(a_q_PxK, a_s_PxKb, b_q_ExNxK, b_s_ExNbxKb, tile_expert_T):
  p, e = a_q_PxK.shape[0], b_q_ExNxK.shape[0]
  if b_q_ExNxK.ndim != 3 or b_s_ExNbxKb.ndim != 3 or b_s_ExNbxKb.shape[0] != e:
    raise ValueError(f"grouped_fp8_gemm: B must be stacked (E, N, K) with tile scales (E, N/128, K/128), got B "
                     f"{tuple(b_q_ExNxK.shape)} and scales {tuple(b_s_ExNbxKb.shape)}")
  n = b_q_ExNxK.shape[1]
  if b_s_ExNbxKb.shape[1] != num_blocks(n):
    raise ValueError(f"grouped_fp8_gemm: B scales must be 128x128 tile scales (E, ceil(N/128), K/128) for B "
                     f"{tuple(b_q_ExNxK.shape)}, got {tuple(b_s_ExNbxKb.shape)} (no row-scale / wgrad mode)")
  sds = jax.ShapeDtypeStruct
  _validate(a_q_PxK, a_s_PxKb, sds(b_q_ExNxK.shape[1:], b_q_ExNxK.dtype), sds(b_s_ExNbxKb.shape[1:], jnp.float32))
  if p % BLOCK or tile_expert_T.shape != (p // BLOCK,) or not jnp.issubdtype(tile_expert_T.dtype, jnp.integer):
    raise ValueError(f"grouped_fp8_gemm: A's tile buffer must have a multiple of {BLOCK} rows and one integer expert "
                     f"id per {BLOCK}-row tile; got A {tuple(a_q_PxK.shape)}, tile_expert "
                     f"{tuple(tile_expert_T.shape)} {tile_expert_T.dtype}")


def _grouped_config(cfg: TuningConfig | None, p: int, n: int, k: int, num_sms: int, choose=None) -> TuningConfig:
  """A requested config, or ``choose``'s pick (``choose_config``'s by default), whose CTA height divides 128 (a CTA's
  rows: one expert)."""
  if cfg is None:
    # Without cross_tile, so that unused tiles are skipped: with balanced routing every group fills whole tiles and
    # the E unused tiles are a fifth of the work at 8192 tokens x top-8 over 128 experts (not yet measured on GPU).
    cfg = dataclasses.replace((choose or choose_config)(p, n, k, num_sms), cross_tile=False)
    if BLOCK % cfg.cta_m:  # 192-row CTAs (3 consumer warpgroups) -> 128-row CTAs
      cfg = dataclasses.replace(cfg, num_wgs=2)
  if BLOCK % cfg.cta_m:
    raise ValueError(f"grouped_fp8_gemm: the CTA height {cfg.cta_m} of {cfg} must divide {BLOCK} (each 128-row tile "
                     f"belongs to one expert)")
  return cfg


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "num_sms"))
def grouped_fp8_gemm_tiles(a_q_PxK, a_s_PxKb, b_q_ExNxK, b_s_ExNbxKb, tile_expert_T, *, out_dtype=jnp.bfloat16,
                           config: TuningConfig | None = None, interpret: bool = False, num_sms: int | None = None):
  """Grouped mode on the tile buffer: C[tile t] = A[tile t] . B[tile_expert_T[t]]^T -> (P, N) ``out_dtype``.

  ``a_q_PxK`` / ``a_s_PxKb``: A's rows in ``grouped_gemm.tile_operands``' layout (P a multiple of 128), E4M3 + 1x128
  scales; ``b_q_ExNxK`` / ``b_s_ExNbxKb``: the experts' E4M3 weights and 128x128 tile scales (the dense kernel's
  forward / dgrad B, stacked); ``tile_expert_T`` (P/128,) int32: each tile's expert, >= E for unused tiles. Unused
  tiles are skipped (their rows of C are unspecified), or with ``cross_tile`` computed against expert E-1 (their A
  rows are zeros: zeros); ``grouped_fp8_gemm`` drops them.

  Invariance contract: the tile -> expert map only moves where the B and B-scale loads start; every output element
  C[m, n] of a tile of expert e goes through exactly the dense kernel's promotion chain (module docstring, item 3)
  over row m of A and row n of B_e, for every config. So the rows of each group are bitwise the rows ``fp8_gemm``
  gives for A = the group's rows and B = expert e alone (tested bitwise on the GPU), and bitwise the same whatever
  the other groups hold or how many rows they have.
  """
  _validate_grouped(a_q_PxK, a_s_PxKb, b_q_ExNxK, b_s_ExNbxKb, tile_expert_T)
  out_dtype = _out_dtype(out_dtype, "grouped_fp8_gemm")
  (p, k), (e, n, _) = a_q_PxK.shape, b_q_ExNxK.shape
  num_sms = num_sms or (4 if interpret else _num_sms())
  cfg = _grouped_config(config, p, n, k, num_sms)
  cfg, mp, grid = _resolve(cfg, p, n, k, out_dtype, False, num_sms, interpret, a_q_PxK.dtype, "grouped_fp8_gemm")
  assert mp == p, (mp, p)  # the CTA height divides 128
  bs = _replicate(jnp.transpose(b_s_ExNbxKb, (2, 0, 1)).reshape(k // BLOCK, -1))  # (Kb, E * 32 * Nb)
  return _launch(a_q_PxK, b_q_ExNxK.reshape(e * n, k), a_s_PxKb.astype(jnp.float32).T, bs,
                 tile_expert_T.astype(jnp.int32), cfg=cfg, row_scales=False, mp=p, n=n, out_dtype=out_dtype,
                 grid=grid, interpret=interpret, kernel_name="fp8jax_grouped_fp8_gemm", num_experts=e)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "num_sms"))
def grouped_fp8_gemm(a_q_MxK, a_s_MxKb, b_q_ExNxK, b_s_ExNbxKb, group_sizes_E, *, out_dtype=jnp.bfloat16,
                     config: TuningConfig | None = None, interpret: bool = False, num_sms: int | None = None):
  """``grouped_gemm.grouped_gemm_reference`` on the kernel: rows sorted by group (sizes traced), -> (M, N).

  Rows move to the tile buffer and back as in the reference (``grouped_gemm.tile_operands`` / ``from_tiles``);
  rows at or beyond sum(group_sizes_E) give zeros. Each group's rows are bitwise ``fp8_gemm`` of those rows with
  B = that expert's weight (``grouped_fp8_gemm_tiles``' invariance contract)."""
  if a_q_MxK.shape[0] == 0:  # no rows: an empty tile buffer, nothing to launch
    return jnp.zeros((0, b_q_ExNxK.shape[1]), out_dtype)
  a_q, a_s, dest, tile_expert = grouped_gemm.tile_operands(a_q_MxK, a_s_MxKb, group_sizes_E, b_q_ExNxK.shape[0])
  out = grouped_fp8_gemm_tiles(a_q, a_s, b_q_ExNxK, b_s_ExNbxKb, tile_expert, out_dtype=out_dtype, config=config,
                               interpret=interpret, num_sms=num_sms)
  return grouped_gemm.from_tiles(out, dest)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "num_sms"))
def grouped_bf16_gemm_tiles(a_PxK, b_ExNxK, tile_expert_T, *, out_dtype=jnp.float32, config: TuningConfig | None = None,
                            interpret: bool = False, num_sms: int | None = None):
  """``bf16_gemm`` in grouped mode on the tile buffer: C[tile t] = A[tile t] . B[tile_expert_T[t]]^T -> (P, N).

  A BF16 (P, K) in ``grouped_gemm.layout``'s tiles, B BF16 stacked (E, N, K), N and K multiples of 128; tiles with
  an id >= E are skipped (their rows of C unspecified). The invariance contract of ``grouped_fp8_gemm_tiles`` in
  BF16 mode: each output element runs the dense BF16 kernel's accumulation (one FP32 wgmma accumulator over K, in
  K order) over its row of A and of B_e, for every config, so each group's rows are bitwise ``bf16_gemm`` of those
  rows against expert e alone (checked on the GPU); reference ``grouped_gemm.dot_tiles_reference``."""
  if b_ExNxK.ndim != 3:
    raise ValueError(f"grouped_bf16_gemm: B must be stacked (E, N, K), got {tuple(b_ExNxK.shape)}")
  _validate_bf16(a_PxK, jax.ShapeDtypeStruct(b_ExNxK.shape[1:], b_ExNxK.dtype))
  (p, k), (e, n, _) = a_PxK.shape, b_ExNxK.shape
  if p % BLOCK or tile_expert_T.shape != (p // BLOCK,) or not jnp.issubdtype(tile_expert_T.dtype, jnp.integer):
    raise ValueError(f"grouped_bf16_gemm: A's tile buffer must have a multiple of {BLOCK} rows and one integer expert "
                     f"id per {BLOCK}-row tile; got A {tuple(a_PxK.shape)}, tile_expert {tuple(tile_expert_T.shape)} "
                     f"{tile_expert_T.dtype}")
  out_dtype = _out_dtype(out_dtype, "grouped_bf16_gemm")
  num_sms = num_sms or (4 if interpret else _num_sms())
  choose = lambda m_, n_, k_, sms: choose_bf16_config(m_, n_, k_, sms, out_dtype)  # noqa: E731
  cfg = _grouped_config(config, p, n, k, num_sms, choose)
  cfg, mp, grid = _resolve(cfg, p, n, k, out_dtype, False, num_sms, interpret, a_PxK.dtype, "grouped_bf16_gemm")
  assert mp == p, (mp, p)  # the CTA height divides 128
  return _launch(a_PxK, b_ExNxK.reshape(e * n, k), tile_expert_T.astype(jnp.int32), cfg=cfg, row_scales=False, mp=p,
                 n=n, out_dtype=out_dtype, grid=grid, interpret=interpret, kernel_name="fp8jax_grouped_bf16_gemm",
                 num_experts=e)


def _group_ranges(tile_expert_T, num_experts: int):
  """Each expert's first tile and tile count in the tile buffer (tiles are sorted by expert; ids >= E unused)."""
  te = tile_expert_T.astype(jnp.int32)
  count = jnp.bincount(jnp.minimum(te, num_experts), length=num_experts + 1)[:num_experts].astype(jnp.int32)
  first = jnp.searchsorted(te, jnp.arange(num_experts, dtype=jnp.int32), side="left").astype(jnp.int32)
  return first, count


# Grouped wgrad schedule: a step-table entry packs the token block (K blocks of the operands) and the output tile's
# row and column block of one pipeline step; the bounds are checked in the wrapper.
_TB_BITS, _BLK_BITS = 15, 8


def _wgrad_schedule(tile_expert_T, num_experts: int, n_rows: int, k_out: int, cfg: TuningConfig, grid: int,
                    sub: int):
  """The grouped-wgrad schedule (``_wgrad_kernel``) -> (step (U,), ctl (U,), off (grid + 1,), count (E,)) int32.

  Output tiles lin = e * tpe + m_blk * n_blocks + n_blk (tpe = tiles per expert) go round robin to the CTAs (lin %
  grid); CTA c runs steps off[c] .. off[c+1] of one pipeline: for each of its tiles in increasing lin, one step per
  K block (``sub`` per 128-token tile) of the tile's expert, in token order. ``step[s]`` = token block << 16 |
  m_blk << 8 | n_blk (what the producer loads); ``ctl[s]`` = lin << 2 | last << 1 | first (what the consumers do).
  Static size U = tiles x sub x tpe >= any total (each token tile belongs to one expert); entries past the total
  are never read. ``count``: each expert's 128-token tiles."""
  t = tile_expert_T.shape[0]
  first, count = _group_ranges(tile_expert_T, num_experts)
  n_blocks = k_out // cfg.cta_n
  m_blocks = n_rows // cfg.cta_m
  tpe = m_blocks * n_blocks
  if t * sub >= 1 << _TB_BITS or m_blocks > 1 << _BLK_BITS or n_blocks > 1 << _BLK_BITS:
    raise ValueError(f"grouped wgrad: {t} token tiles, {m_blocks} x {n_blocks} output blocks per expert exceed the "
                     f"schedule's fields (< {(1 << _TB_BITS) // sub} tiles, <= {1 << _BLK_BITS} blocks)")
  lins = np.arange(num_experts * tpe)
  order = np.argsort(lins % grid, kind="stable")  # CTA-major, increasing lin within a CTA
  per_cta = np.bincount(lins % grid, minlength=grid)
  cta_first = np.concatenate([[0], np.cumsum(per_cta)[:-1]])
  cnt = (count * sub)[order // tpe]  # pipeline steps of each tile, in CTA order
  cum = jnp.cumsum(cnt, dtype=jnp.int32)
  start = cum - cnt
  off = jnp.concatenate([start[cta_first], cum[-1:]]).astype(jnp.int32)
  s = jnp.arange(t * sub * tpe, dtype=jnp.int32)
  ti = jnp.minimum(jnp.searchsorted(cum, s, side="right"), len(order) - 1)
  lin = jnp.asarray(order, jnp.int32)[ti]
  k = s - start[ti]
  rem = lin % tpe
  step = ((first[lin // tpe] * sub + k) << 16) | ((rem // n_blocks) << 8) | (rem % n_blocks)
  ctl = (lin << 2) | ((k == cnt[ti] - 1).astype(jnp.int32) << 1) | (k == 0).astype(jnp.int32)
  return step.astype(jnp.int32), ctl.astype(jnp.int32), off, count


def _wgrad_kernel(*refs, cfg: TuningConfig, num_experts: int, grid: int):
  """Grouped wgrad with one pipeline per CTA over all its output tiles' steps (``_wgrad_schedule``), so the producer
  loads the next tile's first token blocks while the consumers finish this one (tiles are short: 4 steps at
  balanced Qwen3 routing). Refs: a (N, P), b (K, P), [as (T, N), bs (T, K) f32,] step, ctl, off, count, out
  (E*N, K), out_smem. Per step the consumers (FP8) issue one K block's wgmmas into a fresh accumulator and promote
  it, ``acc + blk * (a_scale[m] * b_scale[n])``, as the dense wgrad does; BF16: ``acc + blk`` per 64-token block.
  The accumulator restarts from zero at a tile's first step and the tile's epilogue runs at its last step; tiles of
  experts without tokens get zeros first."""
  scaled = len(refs) == 10
  if scaled:
    a_gmem, b_gmem, as_gmem, bs_gmem, step_gmem, ctl_gmem, off_gmem, count_gmem, out_gmem, out_smem = refs
  else:
    a_gmem, b_gmem, step_gmem, ctl_gmem, off_gmem, count_gmem, out_gmem, out_smem = refs
  n_rows, k_out, out_dtype = a_gmem.shape[0], b_gmem.shape[0], out_gmem.dtype
  cta_m, cta_n, wg_n = cfg.cta_m, cfg.cta_n, cfg.wg_n
  bk = _block_k(a_gmem.dtype)
  n_blocks = k_out // cta_n
  tpe = (n_rows // cta_m) * n_blocks
  transforms = _swizzled(_K_BLOCK_BYTES, a_gmem.dtype.itemsize)
  sm = lax.axis_index("sm")
  base = off_gmem[sm]
  num_steps = off_gmem[sm + 1] - base

  def entry(s):  # (token block, m block, n block) of pipeline step s
    v = step_gmem[base + s]
    return lax.shift_right_logical(v, 16), lax.shift_right_logical(v, 8) & 255, v & 255

  specs = [plgpu.BlockSpec((cta_m, bk), lambda s: (entry(s)[1], entry(s)[0]), transforms=transforms,
                           memory_space=plgpu.SMEM),
           plgpu.BlockSpec((cta_n, bk), lambda s: (entry(s)[2], entry(s)[0]), transforms=transforms,
                           memory_space=plgpu.SMEM)]
  if scaled:
    specs += [plgpu.BlockSpec((1, cta_m), lambda s: (entry(s)[0], entry(s)[1]), memory_space=plgpu.SMEM),
              plgpu.BlockSpec((1, cta_n), lambda s: (entry(s)[0], entry(s)[2]), memory_space=plgpu.SMEM)]

  def get_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(num_steps,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=cfg.num_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps, compute_context=compute_context)

  ignore = lambda *_, **__: None
  gmem = [a_gmem, b_gmem] + ([as_gmem, bs_gmem] if scaled else [])

  @functools.partial(pl.run_scoped, allocs=get_pipeline(ignore, ignore).get_allocations(*gmem), collective_axes="wg")
  def _scope(allocs):
    wg = lax.axis_index("wg")
    wg_m_off, wg_n_off = (wg * WG_M, 0) if cfg.split == "m" else (0, wg * wg_n)
    zeros = lambda: plgpu.layout_cast(jnp.zeros((WG_M, wg_n), jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731

    def epilogue(lin, acc):
      rem = lin % tpe
      row0 = (lin // tpe) * n_rows + (rem // n_blocks) * cta_m
      n0 = (rem % n_blocks) * cta_n
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_smem[wg] = acc.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[pl.ds(row0 + wg_m_off, WG_M), pl.ds(n0 + wg_n_off, wg_n)])

    @pl.when(wg < cfg.num_wgs)
    def _empty_experts():  # this CTA's tiles of experts without tokens: zeros (no pipeline step writes them)
      @pl.loop(0, (num_experts * tpe - sm + grid - 1) // grid)
      def _(j):
        lin = sm + j * grid
        pl.when(count_gmem[lin // tpe] == 0)(lambda: epilogue(lin, zeros()))

    def body(idx, a_smem, b_smem, *rest):
      *scale_smem, acc = rest
      ctl = ctl_gmem[base + idx[0]]
      first = lax.broadcast_in_dim((ctl & 1) == 1, acc.shape, ())  # a tile's first step: restart from zero
      acc = lax.select(first, zeros(), acc)
      a = a_smem.at[pl.ds(wg_m_off, WG_M)]
      b = b_smem.at[pl.ds(wg_n_off, wg_n)].transpose((1, 0))

      def block(blk_ref):
        plgpu.wgmma(blk_ref, a, b)
        if scaled:
          as_smem, bs_smem = scale_smem
          sa = plgpu.load(as_smem.at[0, pl.ds(wg_m_off, WG_M)], layout=plgpu.Layout.WGMMA.reduce(1))
          sb = plgpu.load(bs_smem.at[0, pl.ds(wg_n_off, wg_n)], layout=plgpu.Layout.WGMMA.reduce(0))
          blk = plgpu.wgmma_accumulator_load(blk_ref, wait_n=0)
          return acc + blk * (lax.broadcast_in_dim(sa, (WG_M, wg_n), [0]) * lax.broadcast_in_dim(sb, (WG_M, wg_n), [1]))
        return acc + plgpu.wgmma_accumulator_load(blk_ref, wait_n=0)

      acc = pl.run_scoped(block, plgpu.ACC((WG_M, wg_n), jnp.float32))
      pl.when((ctl & 2) == 2)(lambda: epilogue(lax.shift_right_logical(ctl, 2), acc))  # a tile's last step
      return acc

    def compute_context(eval_pipeline):
      eval_pipeline(zeros())

    pl.when(num_steps > 0)(lambda: get_pipeline(body, compute_context)(*gmem, allocations=allocs))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch_wgrad(*operands, tile_expert_T, num_experts: int, cfg: TuningConfig, n_rows: int, k_out: int,
                  out_dtype, num_sms: int, interpret: bool, kernel_name: str):
  """Runs ``_wgrad_kernel`` -> (E, N, K)."""
  scaled = len(operands) == 4
  bk = _block_k(operands[0].dtype)
  tiles = num_experts * (n_rows // cfg.cta_m) * (k_out // cfg.cta_n)
  grid = min(num_sms, tiles)
  # ring depth: what SMEM holds beside the output staging (a stage: one K block of A and B, and their scale rows)
  stage = (cfg.cta_m + cfg.cta_n) * _K_BLOCK_BYTES + (4 * (cfg.cta_m + cfg.cta_n) if scaled else 0)
  out_bytes = cfg.num_wgs * WG_M * cfg.wg_n * out_dtype.itemsize
  cfg = dataclasses.replace(cfg, max_concurrent_steps=max(2, min(cfg.max_concurrent_steps,
                                                                 (_SMEM_BUDGET - out_bytes) // stage)))
  step, ctl, off, count = _wgrad_schedule(tile_expert_T, num_experts, n_rows, k_out, cfg, grid, BLOCK // bk)
  out_smem_type = plgpu.SMEM((cfg.num_wgs, WG_M, cfg.wg_n), out_dtype,
                             transforms=_swizzled(cfg.wg_n * out_dtype.itemsize, out_dtype.itemsize))
  kernel = plgpu.kernel(
      functools.partial(_wgrad_kernel, cfg=cfg, num_experts=num_experts, grid=grid),
      out_type=jax.ShapeDtypeStruct((num_experts * n_rows, k_out), out_dtype),
      scratch_types=[out_smem_type], grid=(grid,), grid_names=("sm",), num_threads=cfg.num_wgs + 1,
      thread_name="wg", kernel_name=kernel_name, compiler_params=plgpu.CompilerParams(approx_math=False),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return kernel(*operands, step, ctl, off, count).reshape(num_experts, n_rows, k_out)


def _wgrad_config(cfg: TuningConfig | None, n_out: int) -> TuningConfig:
  """Grouped wgrad's config: one K block per step, no clusters, two consumer warpgroups, and no cross-tile pipeline
  of the library's kind (its schedule is its own: ``_wgrad_kernel``)."""
  if cfg is None:
    cfg = TuningConfig("m", 128, 4)
  if cfg.cross_tile or cfg.cluster_n or cfg.num_wgs != 2 or cfg.k_blocks != 1:
    raise ValueError(f"grouped wgrad: the config must have cross_tile=False, cluster_n=False, num_wgs=2 and "
                     f"k_blocks=1 (its own per-CTA schedule), got {cfg}")
  if n_out % cfg.cta_n:
    raise ValueError(f"grouped wgrad: K = {n_out} (dW's columns) is not a multiple of the CTA width {cfg.cta_n} "
                     f"of {cfg}")
  return cfg


def _validate_wgrad(name, a_NxP, b_KxP, tile_expert_T, dtype):
  for what, t in (("A (dy^T)", a_NxP), ("B (x^T)", b_KxP)):
    if t.ndim != 2 or t.dtype != dtype or t.shape[0] % BLOCK:
      raise ValueError(f"{name}: {what} must be 2-D {jnp.dtype(dtype).name} (rows, tokens) with rows a multiple of "
                       f"{BLOCK}, got {t.dtype} {tuple(t.shape)}")
  p = a_NxP.shape[1]
  if b_KxP.shape[1] != p or p % BLOCK or tile_expert_T.shape != (p // BLOCK,) or not jnp.issubdtype(
      tile_expert_T.dtype, jnp.integer):
    raise ValueError(f"{name}: A and B must share the token axis P (a multiple of {BLOCK}) with one integer expert "
                     f"id per {BLOCK}-token tile; got A {tuple(a_NxP.shape)}, B {tuple(b_KxP.shape)}, tile_expert "
                     f"{tuple(tile_expert_T.shape)} {tile_expert_T.dtype}")


@functools.partial(jax.jit, static_argnames=("num_experts", "out_dtype", "config", "interpret", "num_sms"))
def grouped_fp8_wgrad_tiles(a_q_NxP, a_s_NxT, b_q_KxP, b_s_KxT, tile_expert_T, *, num_experts: int,
                            out_dtype=jnp.float32, config: TuningConfig | None = None, interpret: bool = False,
                            num_sms: int | None = None):
  """Grouped FP8 wgrad: dW_e = A[:, tiles of e] . B[:, tiles of e]^T -> (E, N, K) ``out_dtype``.

  Operands are ``grouped_gemm.grouped_wgrad_tiles``' (reference): dy^T and x^T of the tile buffer, E4M3 and
  quantized 1x128 over tokens (``quant.quantize_act_t``): ``a_q_NxP`` (N, P) + scales (N, P/128), ``b_q_KxP``
  (K, P) + scales (K, P/128); ``tile_expert_T`` (P/128,) the tiles' experts, sorted (>= E: unused, never read).

  The dense kernel's wgrad math (row scales) on output tiles of one expert each, contracted over that expert's
  token tiles only; one pipeline per CTA runs all its tiles' steps (``_wgrad_kernel``). Each output element goes
  through the dense promotion chain (module docstring, item 3) over the expert's 128-token blocks in increasing
  token order, so dW_e does not depend on the other groups or on where the group sits (GPU test: bitwise the
  dense kernel's wgrad over the group's columns); the same per-block math and order as the reference (equal to
  it within the wgmma's in-block summation: <= 1e-3 relative on the GPU, bitwise in interpret mode on exact
  operands). Experts without tokens get zeros."""
  _validate_wgrad("grouped_fp8_wgrad", a_q_NxP, b_q_KxP, tile_expert_T, jnp.float8_e4m3fn)
  (n, p), k = a_q_NxP.shape, b_q_KxP.shape[0]
  if a_s_NxT.shape != (n, p // BLOCK) or b_s_KxT.shape != (k, p // BLOCK):
    raise ValueError(f"grouped_fp8_wgrad: scales must be 1x128 over tokens, (N, P/128) = {(n, p // BLOCK)} and "
                     f"(K, P/128) = {(k, p // BLOCK)}; got {tuple(a_s_NxT.shape)} and {tuple(b_s_KxT.shape)}")
  out_dtype = _out_dtype(out_dtype, "grouped_fp8_wgrad")
  num_sms = num_sms or (4 if interpret else _num_sms())
  return _launch_wgrad(a_q_NxP, b_q_KxP, a_s_NxT.astype(jnp.float32).T, b_s_KxT.astype(jnp.float32).T,
                       tile_expert_T=tile_expert_T, num_experts=num_experts, cfg=_wgrad_config(config, k), n_rows=n,
                       k_out=k, out_dtype=out_dtype, num_sms=num_sms, interpret=interpret,
                       kernel_name="fp8jax_grouped_fp8_wgrad")


@functools.partial(jax.jit, static_argnames=("num_experts", "out_dtype", "config", "interpret", "num_sms"))
def grouped_bf16_wgrad_tiles(a_NxP, b_KxP, tile_expert_T, *, num_experts: int, out_dtype=jnp.float32,
                             config: TuningConfig | None = None, interpret: bool = False, num_sms: int | None = None):
  """Grouped BF16 wgrad: dW_e = A[:, tiles of e] . B[:, tiles of e]^T -> (E, N, K), FP32 accumulation.

  A = dy^T (N, P), B = x^T (K, P) of the tile buffer in BF16, N and K multiples of 128. Each output element adds,
  in FP32 and in token order, one wgmma chain per 64-token block of expert e (``_wgrad_kernel``), from zero, never
  split: deterministic and independent of the other groups. Reference
  ``grouped_gemm.dot_tiles_wgrad_by_tile`` (FP32 per-tile products added in tile order: equal within FP32
  rounding, not bitwise)."""
  _validate_wgrad("grouped_bf16_wgrad", a_NxP, b_KxP, tile_expert_T, jnp.bfloat16)
  (n, p), k = a_NxP.shape, b_KxP.shape[0]
  out_dtype = _out_dtype(out_dtype, "grouped_bf16_wgrad")
  num_sms = num_sms or (4 if interpret else _num_sms())
  return _launch_wgrad(a_NxP, b_KxP, tile_expert_T=tile_expert_T, num_experts=num_experts,
                       cfg=_wgrad_config(config, k), n_rows=n, k_out=k, out_dtype=out_dtype, num_sms=num_sms,
                       interpret=interpret, kernel_name="fp8jax_grouped_bf16_wgrad")


def _validate_bf16(a, b):
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"bf16_gemm takes 2-D operands, got A {a.shape} and B {b.shape}")
  (m, k), (n, k2) = a.shape, b.shape
  if k != k2:
    raise ValueError(f"bf16_gemm: contraction dims differ: A {a.shape} vs B {b.shape} (B is stored (N, K))")
  if n % BLOCK or k % BLOCK:
    raise ValueError(f"bf16_gemm (Mosaic GPU): N = {n} and K = {k} (A {a.shape}, B {b.shape}) must be multiples "
                     f"of {BLOCK}; zero-pad them (fp8jax.ops.linear does)")
  if m == 0:
    raise ValueError(f"bf16_gemm (Mosaic GPU): M must be >= 1, got A {a.shape}")
  for name, t in (("A", a), ("B", b)):
    if t.dtype != jnp.bfloat16:
      raise ValueError(f"bf16_gemm: {name} must be bfloat16, got {t.dtype} (shape {t.shape})")


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "num_sms"))
def bf16_gemm(a_MxK, b_NxK, *, out_dtype=jnp.bfloat16, config: TuningConfig | None = None, interpret: bool = False,
              num_sms: int | None = None):
  """C = A . B^T for BF16 A (M, K) and B stored (N, K), FP32 accumulation (module docstring, item 3b); (M, N)."""
  _validate_bf16(a_MxK, b_NxK)
  out_dtype = _out_dtype(out_dtype, "bf16_gemm")
  (m, k), n = a_MxK.shape, b_NxK.shape[0]
  num_sms = num_sms or (4 if interpret else _num_sms())
  cfg, mp, grid = _resolve(config or choose_bf16_config(m, n, k, num_sms, out_dtype), m, n, k, out_dtype, False,
                           num_sms, interpret, a_MxK.dtype, "bf16_gemm")
  out = _launch(_pad_rows(a_MxK, mp), b_NxK, cfg=cfg, row_scales=False, mp=mp, n=n, out_dtype=out_dtype, grid=grid,
                interpret=interpret, kernel_name="fp8jax_bf16_gemm")
  return out[:m] if mp != m else out
