"""The rollout sampler: jitted prefill + decode over the trainer's own model function.

How a batch of requests (prompts x n samples) is generated:
  1. paged KV cache (``fp8jax.kvcache``): one pool of pages per layer, a page being one attention key block; a slot's
     page table names the page of each of its key blocks;
  2. prefill: one forward over the *distinct* prompts (right-padded to a length bucket) writes each prompt's pages
     once; the n samples of a prompt share them (prompt sharing: one prefill per prompt and its pages held once, never
     n times). Only the page holding the last prompt token, where the samples start writing, is copied into each
     sample's own page;
  3. decode attention reads the pages of a prompt once per step for all its samples in the batch (the kernels'
     shared-prefix pass, ``fp8jax.attention.attend(shared_blocks=)``; the same bits as reading them per slot);
  4. continuous batching inside the jitted loop: ``slots`` rows decode one token per step; at the start of every
     step, free slots take the next pending requests (at most ``max_refills_per_step``): their page tables point at
     the prompt's pages, then at the slot's own pages, and they re-read the last prompt token to produce the first
     new token. A finished slot is thus refilled on the next step; the host syncs every ``decode_chunk`` steps only
     to see whether all requests are done;
  5. each decode step computes the logits and their logsumexp with the trainer's chunked head
     (``fp8jax.model.head``: the same row statistics per vocabulary chunk, and the chunked GEMMs' bits; on the
     Hopper kernels one whole-vocabulary GEMM, ``head.whole_vocab_gemm``) and reports z[token] - logsumexp for the
     sampled token. The reported log-prob is that of the temperature-scaled distribution, without top-p/top-k
     renormalization, so sampler-vs-trainer mismatch measures numerics only;
  6. on the Hopper kernels q/k/v and gate/up run as one GEMM each over weights concatenated once per call
     (``fp8jax.model.fuse``: the fused GEMM's columns are bitwise the separate GEMMs').
  7. on a multi-device mesh without tensor parallelism, rollouts are data parallel: every device runs steps 1-6 on
     its own share of the prompts with slots / devices slots, its own pages and a whole copy of the sampling weights
     (gathered once per call), so neither the pool nor the decode loop spans devices (``SamplerConfig.data_parallel``;
     the outputs are the one-device sampler's, bit for bit).
Randomness is per request: the key of generated token i of request r is fold_in(fold_in(key(seed), r), i), so a
request's completion does not depend on which slot or batch it ran in.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import fp8jax
from fp8jax import attention as attn
from fp8jax import kvcache as kvc
from fp8jax import ops, quant, sharding
from fp8jax import recipes
from fp8jax.model import fuse, head, llama
from fp8jax.model.config import ModelConfig

FINISH_STOP, FINISH_LENGTH = 0, 1


def fcfs_decode_steps(lengths, slots: int, max_refills_per_step: int) -> int:
  """Decode steps of the ideal first-come-first-served schedule of requests with these completion ``lengths`` (in
  request order) on ``slots`` slots: every slot takes a request before the first step, and a slot freed by a
  request's last token takes the next pending one on the very next step (at most ``max_refills_per_step`` per
  step). The sampler's loop is this schedule (tests/test_sampler.py checks its step count), so ``generated tokens /
  (these steps x slots)`` is the occupancy the workload itself allows (``stats["occupancy_bound"]``): when lengths
  are not known in advance, no admission order does better in expectation; only a deeper queue does."""
  n, ends, free, t, nxt = len(lengths), [], slots, 0, 0
  while True:
    while ends and ends[0] <= t:  # slots whose request ended on step t - 1
      heapq.heappop(ends)
      free += 1
    if nxt >= n and not ends:
      return t
    k = min(free, n - nxt, slots if t == 0 else max_refills_per_step)
    for length in lengths[nxt:nxt + k]:
      heapq.heappush(ends, t + int(length))
    nxt, free, t = nxt + k, free - k, t + 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0: off
  greedy: bool = False
  max_new_tokens: int = 64
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    if not self.greedy and self.temperature <= 0:
      raise ValueError(f"rollout.temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 1:
      raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  slots: int = 64  # rows of the decode batch (the KV cache's first dim)
  max_len: int = 256  # prompt + completion tokens per slot
  prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)
  kv_cache: str = "bf16"  # "bf16" | "fp8"
  decode_chunk: int = 16  # decode steps per jitted call (the host checks for completion between calls)
  max_refills_per_step: int = 16  # free slots that take a pending request per decode step (each copies one page)
  memory_fraction: float = 0.9  # the KV caches may use at most this fraction of free device memory
  # Two switches that are not config keys (the trainer always runs both on): off, they give the same bits more slowly,
  # which is what the tests and scripts/bench_rollout.py switch them off to check and time.
  # Decode attention reads a prompt's shared pages once for all its samples in the step (the kernels' shared-prefix
  # pass).
  shared_prefix_attention: bool = True
  # q/k/v and gate/up as one GEMM each where the kernels make the fused columns bitwise the separate GEMMs
  # (``fp8jax.model.fuse``).
  fuse_projections: bool = True
  # On a mesh without tensor parallelism, each device generates its own share of the requests: a full copy of the
  # sampling weights (gathered once per generate call), slots / devices slots and its own KV pages (``Sampler``'s
  # "Data-parallel rollouts"). Same tokens and log-probs either way; False: one SPMD program over the mesh, whose
  # page pool every device holds whole and whose weights are gathered layer by layer at every decode step.
  data_parallel: bool = True

  def __post_init__(self):
    if self.kv_cache not in quant.KV_CACHE_KINDS:  # the trainer sets it from fp8.kv_cache, validated by Recipe
      raise ValueError(f"SamplerConfig.kv_cache (fp8.kv_cache in a config) must be one of {quant.KV_CACHE_KINDS}, "
                       f"got {self.kv_cache!r}")
    for name in ("slots", "decode_chunk", "max_refills_per_step"):
      if getattr(self, name) < 1:
        raise ValueError(f"SamplerConfig.{name} (rollout.{name} in a config) must be >= 1, got {getattr(self, name)}")

  def bucket(self, n: int) -> int:
    for b in self.prompt_buckets:
      if b >= n:
        return min(b, self.max_len)
    return self.max_len


@dataclasses.dataclass
class Rollout:
  """Generated completions; row r is request r = prompt_idx * n + sample."""

  prompt_idx: np.ndarray  # (R,)
  prompt_tokens: np.ndarray  # (R, P) right-padded with pad_id
  prompt_lens: np.ndarray  # (R,)
  tokens: np.ndarray  # (R, max_new) completion ids, pad after the end
  logprobs: np.ndarray  # (R, max_new) sampler log-probs of those ids (0 after the end)
  lengths: np.ndarray  # (R,) completion lengths (stop token included)
  finish_reason: np.ndarray  # (R,) FINISH_STOP or FINISH_LENGTH
  stats: dict

  def sequences(self, pad_id: int = 0):
    """(tokens_RxL, targets_mask_Rx(L-1), old_logp_Rx(L-1)) for the trainer, aligned to next-token targets.

    tokens = prompt + completion (right-padded); position t of the last two arrays describes target token t+1.
    """
    r, p = self.prompt_tokens.shape
    m = self.tokens.shape[1]
    seq = np.full((r, p + m), pad_id, np.int32)
    mask = np.zeros((r, p + m - 1), np.float32)
    old = np.zeros((r, p + m - 1), np.float32)
    for i in range(r):
      pl, cl = int(self.prompt_lens[i]), int(self.lengths[i])
      seq[i, :pl] = self.prompt_tokens[i, :pl]
      seq[i, pl:pl + cl] = self.tokens[i, :cl]
      mask[i, pl - 1:pl - 1 + cl] = 1
      old[i, pl - 1:pl - 1 + cl] = self.logprobs[i, :cl]
    return seq, mask, old


def filter_logits(logits_BxV, temperature, top_k: int, top_p: float):
  """Temperature, then top-k, then top-p (nucleus: the smallest set whose probability reaches top_p)."""
  l = logits_BxV.astype(jnp.float32) / temperature
  if top_k > 0:
    kth = jax.lax.top_k(l, top_k)[0][..., -1:]
    l = jnp.where(l < kth, -jnp.inf, l)
  if top_p < 1.0:
    sorted_l = jnp.sort(l, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_l, axis=-1), axis=-1)
    # keep tokens whose preceding cumulative mass is < top_p (the token that crosses top_p is kept)
    keep_sorted = (cum - jax.nn.softmax(sorted_l, axis=-1)) < top_p
    thresh = jnp.min(jnp.where(keep_sorted, sorted_l, jnp.inf), axis=-1, keepdims=True)
    l = jnp.where(l < thresh, -jnp.inf, l)
  return l


def sample_tokens(keys, logits_BxV, sp: SamplingParams):
  if sp.greedy:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  l = filter_logits(logits_BxV, sp.temperature, sp.top_k, sp.top_p)
  return jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, l).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
  cache: kvc.KVCache  # paged; its page table is the slots'
  slot_req: jax.Array  # (S,) request id or -1
  slot_pos: jax.Array  # (S,) position of the token to feed next
  slot_tok: jax.Array  # (S,) token to feed next
  slot_gen: jax.Array  # (S,) tokens generated so far
  next_req: jax.Array  # () the first request no slot has taken yet
  out_tok: jax.Array  # (R, max_new)
  out_lp: jax.Array
  out_len: jax.Array  # (R,)
  out_finish: jax.Array  # (R,)
  steps: jax.Array  # () decode steps run
  busy_steps: jax.Array  # () slot-steps that did useful work


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Requests:
  """What a slot needs to take a request (constant during one generate call)."""
  prompt_of_req: jax.Array  # (R,) prompt index of each request
  prompt_len: jax.Array  # (Np,)
  last_tok: jax.Array  # (Np,) the last prompt token (re-read by the first decode step)
  n_req: jax.Array  # () requests to generate: the first n_req of prompt_of_req (the rest pad a device's share)
  req_offset: jax.Array  # () the call's id of request 0 (data-parallel shares: the device's first request)


@dataclasses.dataclass(frozen=True)
class PageLayout:
  """The pool of one generate call: ``n_prompts x prompt_pages`` prompt pages, then ``slots x own_pages``.

  A request whose prompt has L tokens reads the prompt's pages for its key blocks below (L - 1) // P and its slot's
  own pages from there on (the first one a copy of the prompt page holding token L - 1). It writes positions
  L - 1 .. L - 2 + max_new (< max_len), so ``own_pages`` = min(blocks per slot, (max_new - 1) // P + 2) suffices
  whatever L; everything is static in (prompts, bucket, slots, max_len, max_new): no recompile per batch of prompts.
  """
  page: int  # positions per page (the attention key block)
  blocks: int  # page-table entries per slot (max_len in pages)
  n_prompts: int
  prompt_pages: int
  slots: int
  own_pages: int

  @property
  def n_pages(self) -> int:
    return self.n_prompts * self.prompt_pages + self.slots * self.own_pages

  def prompt_page0(self, prompt):
    """The first of a prompt's (consecutive) pages."""
    return prompt * self.prompt_pages

  def own_page0(self) -> jax.Array:
    """(S,) the first of each slot's (consecutive) own pages."""
    return self.n_prompts * self.prompt_pages + jnp.arange(self.slots, dtype=jnp.int32) * self.own_pages

  def table_rows(self, prompt_S, shared_S) -> jax.Array:
    """(S, blocks) page tables: blocks below ``shared`` on the prompt's pages, the rest on the slot's own pages
    (blocks past the last own page, which no request reaches, repeat it)."""
    j = jnp.arange(self.blocks, dtype=jnp.int32)[None]
    own = self.own_page0()[:, None] + jnp.minimum(j - shared_S[:, None], self.own_pages - 1)
    return jnp.where(j < shared_S[:, None], self.prompt_page0(prompt_S)[:, None] + j, own)

  def own_table(self) -> jax.Array:
    """Every slot on its own pages (the table before any request: idle slots write there only)."""
    zero = jnp.zeros((self.slots,), jnp.int32)
    return self.table_rows(zero, zero)

  def prompt_table(self) -> jax.Array:
    return self.prompt_page0(jnp.arange(self.n_prompts, dtype=jnp.int32))[:, None] + \
        jnp.arange(self.prompt_pages, dtype=jnp.int32)[None]


def prepare_params(params, recipe: recipes.Recipe, dtype=jnp.bfloat16):
  """Sampling weights: ``quantize_params`` for the FP8 layers, the rest cast to the compute dtype.

  The cast changes no result: the model casts BF16-mode weights, embeddings and norms to the compute dtype anyway.
  """
  qp = recipes.quantize_params(params, recipe)
  return jax.tree.map(lambda x: x if isinstance(x, quant.QWeight) else x.astype(dtype), qp,
                      is_leaf=quant.is_fp8_leaf)


# The refit: ``prepare_params`` jitted once per (recipe, dtype). One program for every caller (the rollout worker's
# sampling weights, the learner's frozen reference when the two recipes are the same).
refit = fp8jax.jit(prepare_params, static_argnames=("recipe", "dtype"))


class Sampler:
  """Generates rollouts with the model function. Jitted functions are built once per (configs, shapes).

  The jitted methods take the Sampler as a static argument, so it hashes and compares by its three configs (all it
  holds): a new Sampler with equal configs reuses the programs already compiled instead of compiling its own.
  """

  def __init__(self, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, lcfg: ops.LinearConfig = ops.LinearConfig()):
    self.cfg, self.scfg, self.lcfg = model_cfg, sampler_cfg, lcfg
    if sampler_cfg.max_len > model_cfg.max_seq_len:
      raise ValueError(f"rollout.max_len={sampler_cfg.max_len} exceeds model.max_seq_len={model_cfg.max_seq_len}")
    d = self.rollout_devices()
    if sampler_cfg.slots % d:
      raise ValueError(f"rollout.slots={sampler_cfg.slots} must be a multiple of the {d} devices that generate "
                       f"rollouts (mesh axes {self._rollout_axes()}: each runs slots / {d} of them), or set "
                       f"rollout.data_parallel=False (one program over the mesh)")

  def _key(self):
    return (self.cfg, self.scfg, self.lcfg)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, Sampler) and self._key() == other._key()

  def fuse_projections(self, params):
    """``params`` (``prepare_params`` output) in the sampler's layout: q/k/v and gate/up concatenated where
    ``fuse.fusable`` (same bits; one GEMM per group). As they are when nothing fuses (on CPU, on a mesh, or with
    ``SamplerConfig.fuse_projections`` off), so it costs nothing there; else one jitted copy of those weights.
    ``generate`` calls it; call it first (the rollout worker's refit does) to hold one form only."""
    if not self.scfg.fuse_projections or not fuse.needs_fusing(params, self.lcfg):
      return params
    return self._fuse(params)

  def sampling_form(self, params):
    """``params`` (``prepare_params`` output) in the form ``generate`` runs: ``fuse_projections``, and with
    data-parallel rollouts whole on every device (gathered once). Idempotent: ``generate`` calls it, the rollout
    worker's refit calls it once per step, so a step gathers and fuses once and holds one form."""
    if self.rollout_devices() == 1:
      return self.fuse_projections(params)
    return self._local().fuse_projections(jax.device_put(params, NamedSharding(self.lcfg.mesh, P())))

  @functools.partial(fp8jax.jit, static_argnums=(0,))
  def _fuse(self, params):
    return fuse.fuse_layers(params, self.lcfg)

  def fuse_projections_shape(self, param_shapes):
    """``fuse_projections`` on shapes (``jax.ShapeDtypeStruct`` leaves), for memory plans: the jitted fusion's own
    ``eval_shape`` (a ``jax.eval_shape`` around ``fuse_projections`` would nest it, and fp8jax.jit's compiler options
    are refused in a nested jit)."""
    if not self.scfg.fuse_projections or not fuse.needs_fusing(param_shapes, self.lcfg):
      return param_shapes
    return type(self)._fuse.eval_shape(self, param_shapes)

  def layout(self, n_prompts: int, bucket: int, max_new_tokens: int) -> PageLayout:
    page = kvc.key_block()
    blocks = kvc.padded_len(self.scfg.max_len) // page
    return PageLayout(page=page, blocks=blocks, n_prompts=n_prompts, prompt_pages=-(-bucket // page),
                      slots=self.scfg.slots, own_pages=min(blocks, (max_new_tokens - 1) // page + 2))

  def device_pool(self, n_prompts: int, bucket: int, max_new_tokens: int) -> tuple[PageLayout, int]:
    """(page layout, KV pool bytes) of one device for a call of ``n_prompts`` prompts padded to ``bucket`` tokens:
    the call's pool, or with data-parallel rollouts the pool of one device's share of the prompts."""
    d = self.rollout_devices()
    runner = self if d == 1 else self._local()
    lay = runner.layout(-(-n_prompts // d), bucket, max_new_tokens)
    return lay, runner._pool_bytes(lay)

  def _pool_bytes(self, lay: PageLayout) -> int:
    heads, head_dim, values = self.cfg.kv_cache_layout
    return kvc.cache_bytes(self.cfg.n_layers, lay.n_pages, lay.page, heads, head_dim, self.scfg.kv_cache == "fp8",
                           values)

  # -- jitted pieces ------------------------------------------------------------------------------------------------

  def _prefill_fn(self, params, tokens_PxT, k_scale_L, v_scale_L, lay: PageLayout, kv_cache: str):
    """(the pool with every prompt's pages written, its page table each slot on its own pages; the forward's
    ForwardAux: per-layer K/V amax). ``kv_cache``: the cache kind ("bf16" for the KV-scale calibration)."""
    heads, head_dim, values = self.cfg.kv_cache_layout  # GQA K and V, or MLA's latent
    cache = kvc.init_pages(self.cfg.n_layers, lay.n_pages, lay.prompt_table(), heads, head_dim,
                           fp8=kv_cache == "fp8", k_scale_L=k_scale_L, v_scale_L=v_scale_L, values=values,
                           pair_ordered=self._pair_ordered(kv_cache))
    pos = jnp.broadcast_to(jnp.arange(tokens_PxT.shape[1], dtype=jnp.int32), tokens_PxT.shape)
    _, cache, aux = llama.forward(params, tokens_PxT, self.cfg, self.lcfg, positions_BxT=pos, cache=cache)
    return dataclasses.replace(cache, page_table=lay.own_table()), aux

  # Jitted alone (one device, or one SPMD program over the mesh); data-parallel rollouts trace the plain functions
  # per device inside their own jit.
  _prefill = fp8jax.jit(_prefill_fn, static_argnums=(0, 5, 6))

  def _pair_ordered(self, kv_cache: str) -> bool:
    """An FP8 K/V cache is held in pair order where the attention kernels read it (``KVCache.pair_ordered``: the
    layout that keeps their decode rows bitwise the trainer's); the reference reads natural order."""
    heads, head_dim, values = self.cfg.kv_cache_layout
    if kv_cache != "fp8" or not values:
      return False
    S = jax.ShapeDtypeStruct
    q = S((1, 1, self.cfg.n_heads, head_dim), jnp.dtype(self.cfg.dtype))
    return attn.resolve_backend(self.cfg.attn_backend, q, S((1, 1, heads, head_dim), jnp.float8_e4m3fn)) == "pallas"

  def _take(self, st: _State, rq: _Requests, lay: PageLayout, cap: int) -> _State:
    """Free slots take the next pending requests (at most ``cap``, lowest slots first): page table rows on the
    prompt's pages below the block of its last token and on the slot's own pages from there; that block's prompt
    page copied into the slot's first own page; position on the last prompt token."""
    s, r = st.slot_req.shape[0], rq.prompt_of_req.shape[0]
    free = st.slot_req < 0
    rank = jnp.cumsum(free) - 1
    take = free & (rank < jnp.minimum(rq.n_req - st.next_req, cap))
    req = st.next_req + rank
    p = rq.prompt_of_req[jnp.clip(req, 0, r - 1)]
    plen = rq.prompt_len[p]
    shared = (plen - 1) // lay.page  # blocks read from the prompt's pages
    table = jnp.where(take[:, None], lay.table_rows(p, shared), st.cache.page_table)
    ids = jnp.nonzero(take, size=cap, fill_value=s)[0]  # the taking slots
    idc = jnp.minimum(ids, s - 1)
    dst = jnp.where(ids < s, lay.own_page0()[idc], lay.n_pages)  # no taker: out of range, dropped
    # Only on steps where a slot takes a request: the copies are a scatter per layer and K/V even when every
    # destination is dropped (at 8B on the H200 most likely the profile's 64 scatters of ~11 us per decode step,
    # 0.7 ms of 14.5; docs/history.md). The cache goes through the cond in place (no copy in the compiled loop).
    cache = lax.cond(jnp.any(take), lambda c: kvc.copy_pages(c, lay.prompt_page0(p[idc]) + shared[idc], dst),
                     lambda c: c, dataclasses.replace(st.cache, page_table=table))
    return dataclasses.replace(
        st, cache=cache, slot_req=jnp.where(take, req, st.slot_req), slot_pos=jnp.where(take, plen - 1, st.slot_pos),
        slot_tok=jnp.where(take, rq.last_tok[p], st.slot_tok), slot_gen=jnp.where(take, 0, st.slot_gen),
        next_req=st.next_req + jnp.sum(take, dtype=jnp.int32))

  @functools.partial(fp8jax.jit, static_argnums=(0, 3), donate_argnums=(1,))
  def _start(self, state: _State, rq: _Requests, lay: PageLayout):
    return self._take(state, rq, lay, lay.slots)

  def _decode_fn(self, params, state: _State, rq: _Requests, lay: PageLayout, sp: SamplingParams, steps: int,
                 base_key):
    """Up to ``steps`` decode steps (fewer if every request is done), each starting with the slot refills."""
    c, max_new = self.cfg, sp.max_new_tokens
    params = ops.with_kernel_scales(params, self.lcfg)  # the GEMM kernel's scale layout, once per call (same bits)
    stop_ids = jnp.asarray(sp.stop_token_ids or (-1,), jnp.int32)
    max_len = self.scfg.max_len  # the cache may hold more (whole attention blocks); sequences stop here
    n_req = rq.prompt_of_req.shape[0]
    cap = min(self.scfg.max_refills_per_step, lay.slots)

    def step(carry):
      i, st = carry
      st = self._take(st, rq, lay, cap)
      active = st.slot_req >= 0
      cache = st.cache
      if self.scfg.shared_prefix_attention:  # the blocks a slot reads from its prompt's pages (as _take set them)
        plen = rq.prompt_len[rq.prompt_of_req[jnp.clip(st.slot_req, 0, n_req - 1)]]
        cache = dataclasses.replace(cache, shared_blocks=jnp.where(active, (plen - 1) // lay.page, 0))
      hidden, cache, _ = llama.forward(params, st.slot_tok[:, None], c, self.lcfg,
                                       positions_BxT=st.slot_pos[:, None], cache=cache)
      cache = dataclasses.replace(cache, shared_blocks=None)
      lp_temp = sp.temperature if not sp.greedy else 1.0
      lg, lse = head.logits_and_lse(head.head_weight(params, c.tie_embeddings), hidden[:, 0], self.lcfg, lp_temp)
      keys = jax.vmap(lambda r, g: jax.random.fold_in(jax.random.fold_in(base_key, r), g))(
          jnp.maximum(st.slot_req, 0) + rq.req_offset, st.slot_gen)
      tok = sample_tokens(keys, lg, sp)
      lp = head.token_logprob(lg, lse, tok, lp_temp)
      req = jnp.where(active, st.slot_req, n_req)  # inactive slots write out of range -> dropped
      out_tok = st.out_tok.at[req, st.slot_gen].set(tok, mode="drop")
      out_lp = st.out_lp.at[req, st.slot_gen].set(lp, mode="drop")
      gen = st.slot_gen + 1
      stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
      too_long = (gen >= max_new) | (st.slot_pos + 2 >= max_len)
      done = active & (stopped | too_long)
      out_len = st.out_len.at[jnp.where(done, req, n_req)].set(gen, mode="drop")
      out_finish = st.out_finish.at[jnp.where(done, req, n_req)].set(
          jnp.where(stopped, FINISH_STOP, FINISH_LENGTH), mode="drop")
      st = _State(cache=cache, slot_req=jnp.where(done, -1, st.slot_req),
                  slot_pos=jnp.where(active, st.slot_pos + 1, st.slot_pos), slot_tok=jnp.where(active, tok, st.slot_tok),
                  slot_gen=jnp.where(active, gen, st.slot_gen), next_req=st.next_req, out_tok=out_tok, out_lp=out_lp,
                  out_len=out_len, out_finish=out_finish, steps=st.steps + 1,
                  busy_steps=st.busy_steps + jnp.sum(active))
      return i + 1, st

    def running(carry):
      i, st = carry
      return (i < steps) & ~_all_done(st, rq.n_req)

    return jax.lax.while_loop(running, step, (jnp.int32(0), state))[1]

  _decode = fp8jax.jit(_decode_fn, static_argnums=(0, 4, 5, 6), donate_argnums=(2,))

  # -- driver -------------------------------------------------------------------------------------------------------

  def _check_memory(self, lay: PageLayout):
    s = self.scfg
    need = self._pool_bytes(lay)
    dev = jax.local_devices()[0]  # this process's own (memory_stats of another host's device cannot be read)
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
      if need > s.memory_fraction * free:
        raise ValueError(
            f"the KV cache needs {need / 2**20:.1f} MiB ({lay.n_pages} pages of {lay.page} positions: "
            f"{lay.n_prompts} prompts x {lay.prompt_pages} + rollout.slots={s.slots} x {lay.own_pages} for "
            f"max_new_tokens, rollout.max_len={s.max_len}) but only {free / 2**20:.1f} MiB is free on {dev}; "
            f"lower rollout.slots, rollout.max_new_tokens or the prompts per step, or use fp8.kv_cache='fp8'")
    return need

  def calibrate_kv_scales(self, params, prompts: list[list[int]], margin: float):
    """Per-layer FP8 KV scales from a BF16-cache prefill of ``prompts`` (before any training step).

    The amax includes the padding positions of the bucket (their K/V are real model outputs too), which can only
    make the scales more conservative.
    """
    toks, _ = self._pad_prompts(prompts)
    lay = dataclasses.replace(self.layout(*toks.shape, 1), slots=0)  # the prompts' pages only
    ones = jnp.ones(self.cfg.n_layers)
    # data-parallel rollouts: the one-device program on the weights whole on every device (replicated work, once
    # per run), as their decode steps run; else the call's own program
    runner = self if self.rollout_devices() == 1 else self._local()
    _, aux = runner._prefill(self.sampling_form(params), toks, ones, ones, lay, "bf16")
    return kvc.scales_from_amax(aux.k_amax_L, margin), kvc.scales_from_amax(aux.v_amax_L, margin)

  def _pad_prompts(self, prompts):
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
      raise ValueError("every prompt needs at least one token")
    if lens.max() >= self.scfg.max_len:
      raise ValueError(f"a prompt has {lens.max()} tokens but rollout.max_len={self.scfg.max_len} leaves no room "
                       f"to generate; raise rollout.max_len or truncate prompts")
    bucket = self.scfg.bucket(int(lens.max()))
    toks = np.zeros((len(prompts), bucket), np.int32)
    for i, p in enumerate(prompts):
      toks[i, :len(p)] = p
    return toks, lens

  def generate(self, params, prompts: list[list[int]], sp: SamplingParams, n: int = 1, kv_scales=None) -> Rollout:
    """Generates ``n`` completions for each prompt. ``params`` from ``prepare_params`` (or raw master params)."""
    c, s = self.cfg, self.scfg
    toks, lens = self._pad_prompts(prompts)
    if s.kv_cache == "fp8" and kv_scales is None:
      raise ValueError("fp8.kv_cache='fp8' (SamplerConfig.kv_cache) needs kv_scales (from the trainer's amax or "
                       "calibrate_kv_scales)")
    ks, vs = kv_scales if s.kv_cache == "fp8" else (jnp.ones(c.n_layers), jnp.ones(c.n_layers))
    n_prompts, r = toks.shape[0], toks.shape[0] * n
    t0 = time.perf_counter()
    run = self._run_one if self.rollout_devices() == 1 else self._run_data_parallel
    out, lay, t_prefill = run(params, toks, lens, ks, vs, sp, n)
    out = {k: np.asarray(v) for k, v in out.items()}
    t_total = time.perf_counter() - t0
    out_len = out["lengths"][:r]
    gen_tokens = int(out_len.sum())
    steps = int(out["steps"].max())
    # The ideal schedule of each device's own queue (one device: the whole call's), the slowest one bounding.
    d = self.rollout_devices()
    per_dev = -(-n_prompts // d) * n
    fcfs = max(fcfs_decode_steps(out_len[i * per_dev:(i + 1) * per_dev], lay.slots, s.max_refills_per_step)
               for i in range(d))
    stats = {"prefill_s": t_prefill, "generate_s": t_total, "generated_tokens": gen_tokens,
             "prefill_tokens": int(lens.sum()), "gen_tokens_per_s": gen_tokens / max(t_total - t_prefill, 1e-9),
             "prefill_tokens_per_s": int(lens.sum()) / max(t_prefill, 1e-9), "decode_steps": steps,
             "mean_occupancy": float(out["busy"].sum()) / max(steps * s.slots, 1),
             "occupancy_bound": gen_tokens / max(fcfs * s.slots, 1),
             # one device's pool (with data-parallel rollouts each device holds its share's pages only)
             "kv_pages": lay.n_pages, "kv_cache_bytes": self._pool_bytes(lay), "rollout_devices": d}
    prompt_of_req = np.repeat(np.arange(n_prompts), n)
    return Rollout(prompt_idx=prompt_of_req, prompt_tokens=toks[prompt_of_req], prompt_lens=lens[prompt_of_req],
                   tokens=out["tokens"][:r], logprobs=out["logprobs"][:r], lengths=out_len,
                   finish_reason=out["finish"][:r], stats=stats)

  def _run_one(self, params, toks, lens, ks, vs, sp: SamplingParams, n: int):
    """The call as one program (one device, or SPMD over the mesh): (outputs, page layout, prefill seconds)."""
    s = self.scfg
    params = self.fuse_projections(params)
    n_prompts, bucket = toks.shape
    lay = self.layout(n_prompts, bucket, sp.max_new_tokens)
    self._check_memory(lay)
    r = n_prompts * n
    rq = jax.tree.map(jnp.asarray, _requests(toks, lens, n, n_req=r, offset=0))
    t0 = time.perf_counter()
    cache, _ = self._prefill(params, jnp.asarray(toks), ks, vs, lay, s.kv_cache)
    jax.block_until_ready(cache.k[0])
    t_prefill = time.perf_counter() - t0
    state = self._start(_new_state(cache, s.slots, r, sp.max_new_tokens), rq, lay)
    base_key = jax.random.key(sp.seed)
    static_sp = dataclasses.replace(sp, seed=0)  # the seed is traced (base_key): no recompile per seed
    while True:
      state = self._decode(params, state, rq, lay, static_sp, s.decode_chunk, base_key)
      if bool(_all_done(state, r)):  # one host sync per chunk
        break
    return (dict(tokens=state.out_tok, logprobs=state.out_lp, lengths=state.out_len, finish=state.out_finish,
                 steps=state.steps[None], busy=state.busy_steps[None]), lay, t_prefill)

  # -- data-parallel rollouts ---------------------------------------------------------------------------------------
  #
  # On a mesh without tensor parallelism every device runs the one-device sampler (``_local``: slots / devices
  # slots, no mesh) on its own share of the prompts: prompts [i * Pd, (i + 1) * Pd) on the i-th device of the batch
  # axes (the last share padded with one-token prompts that no slot takes), their pages in its own pool, the
  # weights whole on every device (gathered once per call, not per layer and step). Inside the decode loop no device
  # waits for another; the host syncs once per chunk on the count of devices with requests left. A request's
  # tokens and log-probs do not depend on where it runs: its random key is that of its id in the whole call
  # (``_Requests.req_offset``) and the kernels are batch invariant, so the outputs are the one-device sampler's
  # (tests/test_sampler_parallel.py). Each device's state carries a leading axis of 1, stacked over the devices.

  def _rollout_axes(self) -> tuple[str, ...] | None:
    """The mesh axes whose devices generate their own share of the requests, or None (one program)."""
    mesh = self.lcfg.mesh
    if not self.scfg.data_parallel or not sharding.multi_device(mesh) or sharding.tensor_axis(mesh):
      return None
    return tuple(a for a in sharding.BATCH_AXES if mesh.shape.get(a, 1) > 1) or None

  def rollout_devices(self) -> int:
    """How many devices generate their own share of the requests (1: one program for the call)."""
    axes = self._rollout_axes()
    return 1 if axes is None else math.prod(self.lcfg.mesh.shape[a] for a in axes)

  def _local(self) -> "Sampler":
    """The sampler each device runs in data-parallel rollouts."""
    return Sampler(self.cfg, dataclasses.replace(self.scfg, slots=self.scfg.slots // self.rollout_devices(),
                                                 data_parallel=False),
                   dataclasses.replace(self.lcfg, mesh=None))

  def _run_data_parallel(self, params, toks, lens, ks, vs, sp: SamplingParams, n: int):
    mesh, axes, d = self.lcfg.mesh, self._rollout_axes(), self.rollout_devices()
    local = self._local()

    def put(x, spec):  # a host array every process holds whole, placed by ``spec``
      x = np.asarray(x)
      return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])

    params = self.sampling_form(params)
    n_prompts, bucket = toks.shape
    per = -(-n_prompts // d)  # prompts per device
    pad = per * d - n_prompts
    toks = np.concatenate([toks, np.zeros((pad, bucket), np.int32)])
    lens = np.concatenate([lens, np.ones(pad, np.int32)])
    lay, _ = self.device_pool(n_prompts, bucket, sp.max_new_tokens)  # one device's: ``per`` prompts
    local._check_memory(lay)
    real = np.clip(n_prompts - per * np.arange(d), 0, per) * n  # each device's requests (the rest pad its share)
    rq = _requests(toks, lens, n, n_req=real, offset=per * n * np.arange(d))
    rq = _Requests(prompt_of_req=put(rq.prompt_of_req[:per * n], P()),
                   **{f: put(getattr(rq, f), P(axes)) for f in ("prompt_len", "last_tok", "n_req", "req_offset")})
    scales = put(np.asarray(ks, np.float32), P()), put(np.asarray(vs, np.float32), P())
    t0 = time.perf_counter()
    state = self._dp_start(params, put(toks, P(axes)), *scales, rq, lay, sp.max_new_tokens)
    jax.block_until_ready(state.cache.k[0])
    t_prefill = time.perf_counter() - t0
    key = put(jax.random.key_data(jax.random.key(sp.seed)), P())  # the one-device call's key, as data
    static_sp = dataclasses.replace(sp, seed=0)
    while True:
      state, pending = self._dp_decode(params, state, rq, key, lay, static_sp, self.scfg.decode_chunk)
      if not int(pending):  # one host sync per chunk: devices with requests left
        break
    return self._dp_outputs(state), lay, t_prefill

  def _per_device(self, fn, in_specs, out_specs):
    return sharding.per_device(fn, self.lcfg.mesh, in_specs, out_specs)

  def _rq_specs(self) -> _Requests:
    split = P(self._rollout_axes())
    return _Requests(prompt_of_req=P(), prompt_len=split, last_tok=split, n_req=split, req_offset=split)

  @functools.partial(fp8jax.jit, static_argnums=(0, 6, 7))
  def _dp_start(self, params, toks, ks, vs, rq: _Requests, lay: PageLayout, max_new: int):
    local, split = self._local(), P(self._rollout_axes())

    def body(params, toks, ks, vs, rq):
      rq = _one_share(rq)
      cache, _ = local._prefill_fn(params, toks, ks, vs, lay, local.scfg.kv_cache)
      st = _new_state(cache, lay.slots, rq.prompt_of_req.shape[0], max_new)
      return _stacked(local._take(st, rq, lay, lay.slots))

    return self._per_device(body, (P(), split, P(), P(), self._rq_specs()), split)(params, toks, ks, vs, rq)

  @functools.partial(fp8jax.jit, static_argnums=(0, 5, 6, 7), donate_argnums=(2,))
  def _dp_decode(self, params, state, rq: _Requests, key_data, lay: PageLayout, sp: SamplingParams, steps: int):
    local, axes = self._local(), self._rollout_axes()

    def body(params, state, rq, key_data):
      rq, st = _one_share(rq), _unstacked(state)
      st = local._decode_fn(params, st, rq, lay, sp, steps, jax.random.wrap_key_data(key_data))
      return _stacked(st), lax.psum((~_all_done(st, rq.n_req)).astype(jnp.int32), axes)

    return self._per_device(body, (P(), P(axes), self._rq_specs(), P()), (P(axes), P()))(
        params, state, rq, key_data)

  @functools.partial(fp8jax.jit, static_argnums=(0,))
  def _dp_outputs(self, state):
    """Every device's outputs, concatenated in request order, on every device (readable by every process)."""
    axes = self._rollout_axes()

    def body(state):
      st = _unstacked(state)
      gather = functools.partial(lax.all_gather, axis_name=axes, tiled=True)
      return dict(tokens=gather(st.out_tok), logprobs=gather(st.out_lp), lengths=gather(st.out_len),
                  finish=gather(st.out_finish), steps=gather(st.steps[None]), busy=gather(st.busy_steps[None]))

    return self._per_device(body, (P(axes),), P())(state)


def _requests(toks, lens, n: int, *, n_req, offset) -> _Requests:
  """The requests of ``n`` samples of each prompt (request r is sample r % n of prompt r // n), host arrays."""
  n_prompts = toks.shape[0]
  return _Requests(prompt_of_req=np.repeat(np.arange(n_prompts, dtype=np.int32), n),
                   prompt_len=np.asarray(lens, np.int32), last_tok=np.asarray(toks[np.arange(n_prompts), lens - 1]),
                   n_req=np.asarray(n_req, np.int32), req_offset=np.asarray(offset, np.int32))


def _new_state(cache: kvc.KVCache, slots: int, n_req: int, max_new: int) -> _State:
  zeros = lambda *shape, dt=jnp.int32: jnp.zeros(shape, dt)  # noqa: E731
  return _State(cache=cache, slot_req=jnp.full((slots,), -1, jnp.int32), slot_pos=zeros(slots), slot_tok=zeros(slots),
                slot_gen=zeros(slots), next_req=zeros(), out_tok=zeros(n_req, max_new),
                out_lp=zeros(n_req, max_new, dt=jnp.float32), out_len=zeros(n_req), out_finish=zeros(n_req),
                steps=zeros(), busy_steps=zeros())


def _one_share(rq: _Requests) -> _Requests:
  """A device's requests inside ``shard_map`` (its (1,) count and offset as scalars)."""
  return dataclasses.replace(rq, n_req=rq.n_req[0], req_offset=rq.req_offset[0])


def _stacked(tree):
  return jax.tree.map(lambda x: x[None], tree)


def _unstacked(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _all_done(st: _State, n_requests: int):
  return (st.next_req >= n_requests) & jnp.all(st.slot_req < 0)
