"""The rollout sampler: jitted prefill + decode over the trainer's own model function.

How a batch of requests (prompts x n samples) is generated:
  1. prefill: one forward over the *distinct* prompts (right-padded to a length bucket) fills a prompt KV cache;
     the n samples of a prompt share it (prompt sharing: one prefill per prompt, never n);
  2. continuous batching: ``slots`` rows of a static (slots x max_len) KV cache. A free slot takes the next pending
     request: its prompt's KV rows are copied in, and its position is set to the last prompt token, which the decode
     step re-reads to produce the first new token. When a sequence stops (stop token or length), the slot is freed
     and refilled at the next chunk boundary (every ``decode_chunk`` steps; the decode loop runs inside jit);
  3. each decode step computes the logits and their logsumexp with the trainer's chunked head
     (``fp8jax.model.head``: the same chunked GEMMs and row statistics) and reports z[token] - logsumexp for the
     sampled token. The reported log-prob is that of the temperature-scaled distribution, without top-p/top-k
     renormalization, so sampler-vs-trainer mismatch measures numerics only.
Randomness is per request: the key of generated token i of request r is fold_in(fold_in(key(seed), r), i), so a
request's completion does not depend on which slot or batch it ran in.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax
from fp8jax import kvcache as kvc
from fp8jax import ops, quant
from fp8jax.model import head, llama
from fp8jax.model.config import ModelConfig

FINISH_STOP, FINISH_LENGTH = 0, 1


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
  decode_chunk: int = 16  # decode steps per jitted call (slots are refilled between calls)
  memory_fraction: float = 0.9  # the KV caches may use at most this fraction of free device memory

  def __post_init__(self):
    if self.kv_cache not in quant.KV_CACHE_KINDS:  # the trainer sets it from fp8.kv_cache, validated by Recipe
      raise ValueError(f"SamplerConfig.kv_cache (fp8.kv_cache in a config) must be one of {quant.KV_CACHE_KINDS}, "
                       f"got {self.kv_cache!r}")

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
  cache: kvc.KVCache
  slot_req: jax.Array  # (S,) request id or -1
  slot_pos: jax.Array  # (S,) position of the token to feed next
  slot_tok: jax.Array  # (S,) token to feed next
  slot_gen: jax.Array  # (S,) tokens generated so far
  out_tok: jax.Array  # (R, max_new)
  out_lp: jax.Array
  out_len: jax.Array  # (R,)
  out_finish: jax.Array  # (R,)
  busy_steps: jax.Array  # () slot-steps that did useful work


def prepare_params(params, recipe: quant.Recipe, dtype=jnp.bfloat16):
  """Sampling weights: ``quantize_params`` for the FP8 layers, the rest cast to the compute dtype.

  The cast changes no result: the model casts BF16-mode weights, embeddings and norms to the compute dtype anyway.
  """
  qp = quant.quantize_params(params, recipe)
  return jax.tree.map(lambda x: x if isinstance(x, quant.QWeight) else x.astype(dtype), qp,
                      is_leaf=quant.is_fp8_leaf)


class Sampler:
  """Generates rollouts with the model function. Jitted functions are built once per (configs, shapes).

  The jitted methods take the Sampler as a static argument, so it hashes and compares by its three configs (all it
  holds): a new Sampler with equal configs reuses the programs already compiled instead of compiling its own.
  """

  def __init__(self, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, lcfg: ops.LinearConfig = ops.LinearConfig()):
    self.cfg, self.scfg, self.lcfg = model_cfg, sampler_cfg, lcfg
    if sampler_cfg.max_len > model_cfg.max_seq_len:
      raise ValueError(f"rollout.max_len={sampler_cfg.max_len} exceeds model.max_seq_len={model_cfg.max_seq_len}")

  def _key(self):
    return (self.cfg, self.scfg, self.lcfg)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, Sampler) and self._key() == other._key()

  def _init_cache(self, slots: int, length: int, fp8: bool, k_scale_L=None, v_scale_L=None) -> kvc.KVCache:
    heads, head_dim, values = self.cfg.kv_cache_layout  # GQA K and V, or MLA's latent
    return kvc.init_cache(self.cfg.n_layers, slots, length, heads, head_dim, fp8=fp8, k_scale_L=k_scale_L,
                          v_scale_L=v_scale_L, values=values)

  def _cache_bytes(self, slots: int, length: int, fp8: bool) -> int:
    heads, head_dim, values = self.cfg.kv_cache_layout
    return kvc.cache_bytes(self.cfg.n_layers, slots, length, heads, head_dim, fp8, values)

  # -- jitted pieces ------------------------------------------------------------------------------------------------

  @functools.partial(fp8jax.jit, static_argnums=(0,))
  def _prefill(self, params, tokens_PxT, k_scale_L, v_scale_L):
    c = self.cfg
    cache = self._init_cache(tokens_PxT.shape[0], tokens_PxT.shape[1], self.scfg.kv_cache == "fp8", k_scale_L,
                             v_scale_L)
    pos = jnp.broadcast_to(jnp.arange(tokens_PxT.shape[1], dtype=jnp.int32), tokens_PxT.shape)
    _, cache, aux = llama.forward(params, tokens_PxT, c, self.lcfg, positions_BxT=pos, cache=cache)
    return cache, aux

  @functools.partial(fp8jax.jit, static_argnums=(0,), donate_argnums=(1,))
  def _refill(self, state: _State, prompt_cache, new_req_S, prompt_of_req, prompt_lens, prompt_last_tok):
    """Slots with new_req >= 0 start request new_req: copy its prompt's KV rows, point at its last prompt token."""
    take = new_req_S >= 0
    p_idx = prompt_of_req[jnp.maximum(new_req_S, 0)]
    plen = prompt_lens[p_idx]
    rows = jnp.where(take, jnp.arange(take.shape[0]), take.shape[0])  # out-of-range rows are dropped
    s = prompt_cache.max_len

    def cp(dst, src):
      return dst.at[rows, :s].set(src[p_idx].astype(dst.dtype), mode="drop")

    cache = dataclasses.replace(state.cache, k=[cp(d, x) for d, x in zip(state.cache.k, prompt_cache.k)],
                                v=[cp(d, x) for d, x in zip(state.cache.v, prompt_cache.v)])
    return dataclasses.replace(
        state, cache=cache, slot_req=jnp.where(take, new_req_S, state.slot_req),
        slot_pos=jnp.where(take, plen - 1, state.slot_pos),
        slot_tok=jnp.where(take, prompt_last_tok[p_idx], state.slot_tok),
        slot_gen=jnp.where(take, 0, state.slot_gen))

  @functools.partial(fp8jax.jit, static_argnums=(0, 3, 4), donate_argnums=(2,))
  def _decode(self, params, state: _State, sp: SamplingParams, steps: int, base_key):
    c, max_new = self.cfg, sp.max_new_tokens
    stop_ids = jnp.asarray(sp.stop_token_ids or (-1,), jnp.int32)
    max_len = self.scfg.max_len  # the cache may hold more (whole attention blocks); sequences stop here

    def step(_, st: _State):
      active = st.slot_req >= 0
      hidden, cache, _ = llama.forward(params, st.slot_tok[:, None], c, self.lcfg,
                                       positions_BxT=st.slot_pos[:, None], cache=st.cache)
      lp_temp = sp.temperature if not sp.greedy else 1.0
      lg, lse = head.logits_and_lse(head.head_weight(params, c.tie_embeddings), hidden[:, 0], self.lcfg, lp_temp)
      keys = jax.vmap(lambda r, g: jax.random.fold_in(jax.random.fold_in(base_key, r), g))(
          jnp.maximum(st.slot_req, 0), st.slot_gen)
      tok = sample_tokens(keys, lg, sp)
      lp = head.token_logprob(lg, lse, tok, lp_temp)
      req = jnp.where(active, st.slot_req, st.out_tok.shape[0])  # inactive slots write out of range -> dropped
      out_tok = st.out_tok.at[req, st.slot_gen].set(tok, mode="drop")
      out_lp = st.out_lp.at[req, st.slot_gen].set(lp, mode="drop")
      gen = st.slot_gen + 1
      stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
      too_long = (gen >= max_new) | (st.slot_pos + 2 >= max_len)
      done = active & (stopped | too_long)
      out_len = st.out_len.at[jnp.where(done, req, st.out_tok.shape[0])].set(gen, mode="drop")
      out_finish = st.out_finish.at[jnp.where(done, req, st.out_tok.shape[0])].set(
          jnp.where(stopped, FINISH_STOP, FINISH_LENGTH), mode="drop")
      return _State(cache=cache, slot_req=jnp.where(done, -1, st.slot_req),
                    slot_pos=jnp.where(active, st.slot_pos + 1, st.slot_pos), slot_tok=jnp.where(active, tok, st.slot_tok),
                    slot_gen=jnp.where(active, gen, st.slot_gen), out_tok=out_tok, out_lp=out_lp, out_len=out_len,
                    out_finish=out_finish, busy_steps=st.busy_steps + jnp.sum(active))

    return jax.lax.fori_loop(0, steps, step, state)

  # -- driver -------------------------------------------------------------------------------------------------------

  def _check_memory(self, n_prompts: int, bucket: int):
    s = self.scfg
    fp8 = s.kv_cache == "fp8"
    need = self._cache_bytes(s.slots, s.max_len, fp8) + self._cache_bytes(n_prompts, bucket, fp8)
    dev = jax.local_devices()[0]  # this process's own (memory_stats of another host's device cannot be read)
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
      if need > s.memory_fraction * free:
        raise ValueError(
            f"KV caches need {need / 2**30:.2f} GiB (rollout.slots={s.slots} x rollout.max_len={s.max_len} "
            f"+ {n_prompts} prompts x {bucket}) but only {free / 2**30:.2f} GiB is free on {dev}; "
            f"lower rollout.slots or rollout.max_len, or use fp8.kv_cache='fp8'")
    return need

  @functools.partial(fp8jax.jit, static_argnums=(0,))
  def _calibration_amax(self, params, tokens_PxT):
    c = self.cfg
    pos = jnp.broadcast_to(jnp.arange(tokens_PxT.shape[1], dtype=jnp.int32), tokens_PxT.shape)
    cache = self._init_cache(tokens_PxT.shape[0], tokens_PxT.shape[1], False)
    _, _, aux = llama.forward(params, tokens_PxT, c, self.lcfg, positions_BxT=pos, cache=cache)
    return aux.k_amax_L, aux.v_amax_L

  def calibrate_kv_scales(self, params, prompts: list[list[int]], margin: float):
    """Per-layer FP8 KV scales from a BF16-cache prefill of ``prompts`` (before any training step).

    The amax includes the padding positions of the bucket (their K/V are real model outputs too), which can only
    make the scales more conservative.
    """
    toks, _ = self._pad_prompts(prompts)
    k_amax, v_amax = self._calibration_amax(params, toks)
    return kvc.scales_from_amax(k_amax, margin), kvc.scales_from_amax(v_amax, margin)

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
    return jnp.asarray(toks), lens

  def generate(self, params, prompts: list[list[int]], sp: SamplingParams, n: int = 1, kv_scales=None) -> Rollout:
    """Generates ``n`` completions for each prompt. ``params`` from ``prepare_params`` (or raw master params)."""
    c, s = self.cfg, self.scfg
    toks, lens = self._pad_prompts(prompts)
    n_prompts, bucket = toks.shape
    self._check_memory(n_prompts, bucket)
    fp8 = s.kv_cache == "fp8"
    if fp8 and kv_scales is None:
      raise ValueError("fp8.kv_cache='fp8' (SamplerConfig.kv_cache) needs kv_scales (from the trainer's amax or "
                       "calibrate_kv_scales)")
    ks, vs = kv_scales if fp8 else (jnp.ones(c.n_layers), jnp.ones(c.n_layers))
    r = n_prompts * n
    t0 = time.perf_counter()
    prompt_cache, _ = self._prefill(params, toks, ks, vs)
    jax.block_until_ready(prompt_cache.k[0])
    t_prefill = time.perf_counter() - t0

    state = _State(
        cache=self._init_cache(s.slots, s.max_len, fp8, ks, vs),
        slot_req=jnp.full((s.slots,), -1, jnp.int32), slot_pos=jnp.zeros((s.slots,), jnp.int32),
        slot_tok=jnp.zeros((s.slots,), jnp.int32), slot_gen=jnp.zeros((s.slots,), jnp.int32),
        out_tok=jnp.zeros((r, sp.max_new_tokens), jnp.int32), out_lp=jnp.zeros((r, sp.max_new_tokens), jnp.float32),
        out_len=jnp.zeros((r,), jnp.int32), out_finish=jnp.zeros((r,), jnp.int32), busy_steps=jnp.zeros((), jnp.int32))
    prompt_of_req = jnp.asarray(np.repeat(np.arange(n_prompts), n), jnp.int32)
    last_tok = toks[jnp.arange(n_prompts), jnp.asarray(lens) - 1]
    lens_j = jnp.asarray(lens)
    base_key = jax.random.key(sp.seed)
    static_sp = dataclasses.replace(sp, seed=0)  # the seed is traced (base_key): no recompile per seed
    next_req, steps, free = 0, 0, np.ones(s.slots, bool)
    while True:
      if next_req < r and free.any():
        new = np.full(s.slots, -1, np.int32)
        idx = np.flatnonzero(free)[: r - next_req]
        new[idx] = np.arange(next_req, next_req + len(idx))
        next_req += len(idx)
        state = self._refill(state, prompt_cache, jnp.asarray(new), prompt_of_req, lens_j, last_tok)
      state = self._decode(params, state, static_sp, s.decode_chunk, base_key)
      steps += s.decode_chunk
      free = np.asarray(state.slot_req) < 0  # one host sync per chunk
      if next_req >= r and free.all():
        break
    out_len = np.asarray(state.out_len)
    t_total = time.perf_counter() - t0
    gen_tokens = int(out_len.sum())
    stats = {"prefill_s": t_prefill, "generate_s": t_total, "generated_tokens": gen_tokens,
             "prefill_tokens": int(lens.sum()), "gen_tokens_per_s": gen_tokens / max(t_total - t_prefill, 1e-9),
             "prefill_tokens_per_s": int(lens.sum()) / max(t_prefill, 1e-9), "decode_steps": steps,
             "mean_occupancy": float(np.asarray(state.busy_steps)) / max(steps * s.slots, 1)}
    toks_np = np.asarray(toks)
    return Rollout(prompt_idx=np.asarray(prompt_of_req), prompt_tokens=toks_np[np.asarray(prompt_of_req)],
                   prompt_lens=lens[np.asarray(prompt_of_req)], tokens=np.asarray(state.out_tok),
                   logprobs=np.asarray(state.out_lp), lengths=out_len, finish_reason=np.asarray(state.out_finish),
                   stats=stats)

