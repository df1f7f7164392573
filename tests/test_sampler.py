"""The rollout sampler (issue 6): greedy == full forward, seeded sampling, filters, stops, continuous batching,
prompt sharing, sampler-vs-trainer log-probs (BF16 / FP8 weights x BF16 / FP8 KV cache), FP8 KV round trip, errors.

CPU, tiny model. Compilation dominates the runtime, so samplers are built once per (slots, kv_cache) by ``sampler``
and the tests share prompts and sampling params: a jitted step is keyed by the Sampler object, the shapes and the
(static) SamplingParams, so reusing all three reuses the compiled code.
"""

import fp8jax

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import kvcache, quant
from fp8jax import recipes
from fp8jax import sampler as smp
from fp8jax.model import llama
from fp8jax.model.config import ModelConfig
from fp8jax.rl import grpo

CFG = ModelConfig(vocab_size=128, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512)
# std 0.1 (not the default 0.02) gives peaked logits (max prob ~0.16 over 128 tokens): greedy argmax has clear
# margins, and sampled completions still vary.
INIT_STD = 0.1
MAX_LEN = 64
BF16, FP8 = recipes.Recipe(mode="bf16"), recipes.Recipe()
RECIPES = {"bf16": BF16, "fp8": FP8}
PROMPTS = [[5, 17, 33, 2, 9], [100, 3, 64, 64, 7, 8, 21, 90, 11], list(range(40, 54))]  # ragged: 5, 9, 14
# greedy / stop / length tests add a 60-token prompt: MAX_LEN leaves it room for 4 of the 12 new tokens
LONG_PROMPT = list(range(1, 61))
PROMPTS_G = PROMPTS + [LONG_PROMPT]
N = 2  # samples per prompt
STOP = (3, 7, 11, 19, 23, 42, 77, 101)  # ~8/128 of the mass per step: lengths get a long tail up to max_new
SP = smp.SamplingParams(temperature=0.8, top_k=64, top_p=0.95, max_new_tokens=16, stop_token_ids=STOP, seed=0)
GREEDY = smp.SamplingParams(greedy=True, max_new_tokens=12)


@pytest.fixture(scope="module")
def master():
  return llama.init_params(CFG, seed=0, std=INIT_STD)


@pytest.fixture(scope="module")
def sparams(master):
  """Sampling weights per recipe (what the RL loop hands the sampler)."""
  return {k: smp.prepare_params(master, r) for k, r in RECIPES.items()}


@pytest.fixture(scope="module")
def kv_scales(master, sparams):
  """FP8 KV scales per recipe, calibrated on the prompts (before any training step)."""
  return {k: sampler(4, "fp8").calibrate_kv_scales(p, PROMPTS, margin=1.25) for k, p in sparams.items()}


@functools.cache
def sampler(slots: int, kv: str = "bf16", decode_chunk: int = 8, refills: int = 16) -> smp.Sampler:
  return smp.Sampler(CFG, smp.SamplerConfig(slots=slots, max_len=MAX_LEN, kv_cache=kv, decode_chunk=decode_chunk,
                                            max_refills_per_step=refills))


@functools.cache
def _trainer_fn(with_kv_scales: bool, temperature: float):
  if with_kv_scales:
    return fp8jax.jit(lambda p, t, s: llama.next_token_logprobs(p, t, CFG, temperature=temperature, kv_scales=s)[0])
  return fp8jax.jit(lambda p, t: llama.next_token_logprobs(p, t, CFG, temperature=temperature)[0])


def trainer_mismatch(master, recipe, ro: smp.Rollout, temperature, kv_scales=None) -> dict:
  """grpo.mismatch_metrics between the rollout's log-probs and the trainer's forward on ``Rollout.sequences()``."""
  seq, mask, old = ro.sequences()
  tp = recipes.mark_fp8(master, recipe)  # the trainer's params: FP8 layers quantized on the fly (differentiable)
  fn = _trainer_fn(kv_scales is not None, temperature)
  train_lp = fn(tp, jnp.asarray(seq), kv_scales) if kv_scales is not None else fn(tp, jnp.asarray(seq))
  m = grpo.mismatch_metrics(jnp.asarray(old), train_lp, jnp.asarray(mask))
  return {k: float(v) for k, v in m.items()}


@fp8jax.jit
def _full_logits(params, tokens_BxL):
  h, _, _ = llama.forward(params, tokens_BxL, CFG)
  return llama.logits(params, h, CFG)


# ------------------------------------------------------------------------------------------------------------------
# Greedy, seeds, prompt sharing
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_greedy_equals_argmax_of_full_forwards(sparams, recipe):
  """Greedy decode == argmax of repeated full-sequence forwards, and its log-probs are theirs.

  The reference re-runs the whole (prompt + generated so far) sequence each step. It is right-padded to a fixed
  width, which changes nothing before the padding (causal), so one compiled forward serves every step.
  """
  p = sparams[recipe]
  ro = sampler(4).generate(p, PROMPTS_G, GREEDY, n=1)
  lens = np.array([len(pr) for pr in PROMPTS_G])
  np.testing.assert_array_equal(ro.lengths, np.minimum(GREEDY.max_new_tokens, MAX_LEN - lens))
  seq_BxL = np.zeros((len(PROMPTS_G), MAX_LEN + GREEDY.max_new_tokens), np.int32)
  for i, pr in enumerate(PROMPTS_G):
    seq_BxL[i, :len(pr)] = pr
  rows = np.arange(len(PROMPTS_G))
  ref_tok, ref_lp, margins = [], [], []
  for step in range(GREEDY.max_new_tokens):
    lg_BxV = np.asarray(_full_logits(p, jnp.asarray(seq_BxL)))[rows, lens - 1 + step]
    tok = lg_BxV.argmax(-1)
    top2 = np.sort(lg_BxV, -1)[:, -2:]
    margins.append(top2[:, 1] - top2[:, 0])
    ref_tok.append(tok)
    ref_lp.append(np.asarray(jax.nn.log_softmax(jnp.asarray(lg_BxV), -1))[rows, tok])
    seq_BxL[rows, lens + step] = tok
  ref_tok, ref_lp = np.stack(ref_tok, 1), np.stack(ref_lp, 1)
  for i, n_i in enumerate(ro.lengths):
    np.testing.assert_array_equal(ro.tokens[i, :n_i], ref_tok[i, :n_i],
                                  err_msg=f"row {i}; min top-2 logit margin {np.min(margins):.3g}")
    np.testing.assert_allclose(ro.logprobs[i, :n_i], ref_lp[i, :n_i], atol=2e-6, rtol=0)


def test_seeded_sampling_reproducible_and_prompt_sharing(sparams, monkeypatch):
  """Same seed -> same rollout; another seed -> another one. One prefill row per distinct prompt, not per sample."""
  s, p = sampler(4), sparams["bf16"]
  prefill_rows = []
  orig = smp.Sampler._prefill

  def spy(self, params, tokens_PxT, *a):
    prefill_rows.append(tokens_PxT.shape[0])
    return orig(self, params, tokens_PxT, *a)

  monkeypatch.setattr(smp.Sampler, "_prefill", spy)
  a = s.generate(p, PROMPTS, SP, n=N)
  b = s.generate(p, PROMPTS, SP, n=N)
  c = s.generate(p, PROMPTS, dataclasses.replace(SP, seed=1), n=N)
  assert prefill_rows == [len(PROMPTS)] * 3, prefill_rows
  assert a.stats["prefill_tokens"] == sum(len(pr) for pr in PROMPTS)
  for x in ("tokens", "logprobs", "lengths", "finish_reason"):
    np.testing.assert_array_equal(getattr(a, x), getattr(b, x))
  assert not np.array_equal(a.tokens, c.tokens)
  # the n samples of a prompt share its prompt but draw their own keys
  np.testing.assert_array_equal(a.prompt_idx, np.repeat(np.arange(len(PROMPTS)), N))
  for i in range(len(PROMPTS)):
    r0, r1 = i * N, i * N + 1
    assert a.prompt_lens[r0] == a.prompt_lens[r1] == len(PROMPTS[i])
    np.testing.assert_array_equal(a.prompt_tokens[r0], a.prompt_tokens[r1])
  assert any(not np.array_equal(a.tokens[i * N], a.tokens[i * N + 1]) for i in range(len(PROMPTS)))
  assert np.all(np.isfinite(a.logprobs)) and np.all(a.logprobs <= 0)


def test_equal_samplers_share_compiled_programs(sparams):
  """The jitted steps take the Sampler as a static argument: a new Sampler with the same configs must hit the
  programs the first one compiled (before, each Sampler object compiled its own), and a different config must not."""
  p, steps = sparams["bf16"], (smp.Sampler._prefill, smp.Sampler._start, smp.Sampler._decode)
  make = lambda **kw: smp.Sampler(CFG, smp.SamplerConfig(slots=3, max_len=MAX_LEN, **kw))
  a = make().generate(p, PROMPTS, SP, n=1)
  sizes = [f._cache_size() for f in steps]
  b = make().generate(p, PROMPTS, SP, n=1)
  assert [f._cache_size() for f in steps] == sizes
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert make() == make() and hash(make()) == hash(make()) and make() != make(decode_chunk=4)
  make(decode_chunk=4).generate(p, PROMPTS, SP, n=1)
  assert steps[2]._cache_size() == sizes[2] + 1


# ------------------------------------------------------------------------------------------------------------------
# Filters: distribution tests on a toy logits vector
# ------------------------------------------------------------------------------------------------------------------

DRAWS = 40_000
TOY_P = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])  # token 0 is the most likely
TOY_LOGITS = jnp.log(jnp.asarray(TOY_P, jnp.float32))[jnp.asarray([3, 0, 5, 1, 4, 2])]  # shuffled order


def _frequencies(sp: smp.SamplingParams, logits_V=TOY_LOGITS, draws=DRAWS):
  keys = jax.random.split(jax.random.key(1234), draws)
  # logits are an argument, not a closed-over constant: XLA would constant-fold the (draws x V) argmax for seconds
  toks = fp8jax.jit(lambda k, l: smp.sample_tokens(k, jnp.broadcast_to(l, (draws, l.shape[0])), sp))(keys, logits_V)
  return np.bincount(np.asarray(toks), minlength=logits_V.shape[0]) / draws


def _expected(logits_V, temperature, keep):
  p = np.exp(np.asarray(logits_V, np.float64) / temperature) * keep
  return p / p.sum()


def _assert_close_to(freq, expected):
  """Max-abs-frequency bound: 5 standard deviations of a binomial frequency (p(1-p)/N), per token."""
  bound = 5 * np.sqrt(expected * (1 - expected) / DRAWS) + 1e-12
  assert np.all(np.abs(freq - expected) <= bound), (freq, expected, bound)
  assert np.all(freq[expected == 0] == 0), "a filtered-out token was sampled"


def _keep_of(order_desc_idx, n, v):
  keep = np.zeros(v)
  keep[order_desc_idx[:n]] = 1
  return keep


ORDER = np.argsort(-np.asarray(TOY_LOGITS))  # token ids by decreasing probability


def test_plain_sampling_matches_softmax():
  _assert_close_to(_frequencies(smp.SamplingParams()), _expected(TOY_LOGITS, 1.0, 1))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_matches_scaled_softmax(temperature):
  _assert_close_to(_frequencies(smp.SamplingParams(temperature=temperature)), _expected(TOY_LOGITS, temperature, 1))


def test_small_temperature_approaches_argmax():
  freq = _frequencies(smp.SamplingParams(temperature=0.02))
  assert freq[ORDER[0]] == 1.0  # p(second) / p(first) = (0.25/0.4)^50 ~ 6e-11
  np.testing.assert_array_equal(_frequencies(smp.SamplingParams(greedy=True)), np.eye(6)[ORDER[0]])


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_top_k_keeps_the_k_largest(top_k):
  keep = _keep_of(ORDER, top_k, 6)
  l = smp.filter_logits(TOY_LOGITS[None], 1.0, top_k, 1.0)[0]
  np.testing.assert_array_equal(np.isfinite(l), keep > 0)
  _assert_close_to(_frequencies(smp.SamplingParams(top_k=top_k)), _expected(TOY_LOGITS, 1.0, keep))


@pytest.mark.parametrize("top_p, n_kept", [(0.3, 1), (0.6, 2), (0.7, 3), (0.85, 4), (0.97, 6), (1.0, 6)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, n_kept):
  """Cumulative mass by decreasing prob: 0.40, 0.65, 0.80, 0.90, 0.96, 1.0 -> the first prefix reaching top_p."""
  keep = _keep_of(ORDER, n_kept, 6)
  l = smp.filter_logits(TOY_LOGITS[None], 1.0, 0, top_p)[0]
  np.testing.assert_array_equal(np.isfinite(l), keep > 0)
  _assert_close_to(_frequencies(smp.SamplingParams(top_p=top_p)), _expected(TOY_LOGITS, 1.0, keep))


def test_temperature_then_top_k_then_top_p():
  """T=2 flattens to p ~ (0.30, 0.24, 0.18, 0.15, 0.12, 0.01..); top_k=4 renormalizes; top_p=0.7 cuts that."""
  l = np.asarray(smp.filter_logits(TOY_LOGITS[None], 2.0, 4, 0.7)[0])
  p4 = _expected(TOY_LOGITS, 2.0, _keep_of(ORDER, 4, 6))
  cum = np.cumsum(p4[ORDER])
  n_kept = int(np.argmax(cum >= 0.7)) + 1
  keep = _keep_of(ORDER, n_kept, 6)
  np.testing.assert_array_equal(np.isfinite(l), keep > 0)
  _assert_close_to(_frequencies(smp.SamplingParams(temperature=2.0, top_k=4, top_p=0.7)),
                   _expected(TOY_LOGITS, 2.0, keep))


# ------------------------------------------------------------------------------------------------------------------
# Stops and lengths
# ------------------------------------------------------------------------------------------------------------------


def test_stop_tokens_and_max_length(sparams):
  """A stop token ends a completion (it is included, FINISH_STOP); max_new_tokens and max_len end it with
  FINISH_LENGTH; positions after the end hold pad 0 and log-prob 0."""
  s, p = sampler(4), sparams["bf16"]
  free = s.generate(p, PROMPTS_G, GREEDY, n=1)  # no stop tokens (the greedy test's call: compiled already)
  # max_len: the 60-token prompt leaves room for MAX_LEN - 60 = 4 tokens (< max_new_tokens = 12)
  np.testing.assert_array_equal(free.lengths, [GREEDY.max_new_tokens] * 3 + [MAX_LEN - len(LONG_PROMPT)])
  np.testing.assert_array_equal(free.finish_reason, [smp.FINISH_LENGTH] * 4)
  seq, mask, _ = free.sequences()
  assert mask[3].sum() == 4 and np.all(seq[3, :60] == LONG_PROMPT) and np.all(seq[3, 60:64] == free.tokens[3, :4])
  # stop on the 4th greedy token of prompt 0 (or its first earlier occurrence), plus an id no model can produce
  stop_tok = int(free.tokens[0, 3])
  sp = dataclasses.replace(GREEDY, stop_token_ids=(stop_tok, CFG.vocab_size + 5))
  ro = s.generate(p, PROMPTS_G, sp, n=1)
  n_stop = 0
  for i in range(len(PROMPTS_G)):
    hits = np.flatnonzero(free.tokens[i, :free.lengths[i]] == stop_tok)
    n_i = int(hits[0]) + 1 if len(hits) else int(free.lengths[i])
    n_stop += bool(len(hits))
    assert ro.lengths[i] == n_i
    assert ro.finish_reason[i] == (smp.FINISH_STOP if len(hits) else smp.FINISH_LENGTH)
    np.testing.assert_array_equal(ro.tokens[i, :n_i], free.tokens[i, :n_i])
    np.testing.assert_array_equal(ro.logprobs[i, :n_i], free.logprobs[i, :n_i])
    assert np.all(ro.tokens[i, n_i:] == 0) and np.all(ro.logprobs[i, n_i:] == 0)
    if len(hits):
      assert ro.tokens[i, n_i - 1] == stop_tok
  assert ro.lengths[0] <= 4 and n_stop < len(PROMPTS_G), "want both finish reasons in one batch"


# ------------------------------------------------------------------------------------------------------------------
# Continuous batching
# ------------------------------------------------------------------------------------------------------------------


def _scheduled_steps(lengths, slots: int, cap: int) -> int:
  """Decode steps of the sampler's schedule, simulated on the host: at the start of each step free slots (lowest
  first) take the next requests in order, at most ``cap`` (every slot before the first step); a slot is free again
  the step after its last token."""
  left, pending, steps = [0] * slots, list(lengths), 0
  while pending or any(left):
    taken = 0
    for i in range(slots):
      if not left[i] and pending and taken < (cap if steps else slots):
        left[i], taken = pending.pop(0), taken + 1
    left = [max(0, x - 1) for x in left]
    steps += 1
  return steps


@pytest.mark.parametrize("slots,cap", [(1, 1), (4, 16), (4, 1), (7, 2), (64, 16)])
def test_fcfs_decode_steps_is_the_slot_by_slot_schedule(slots, cap):
  """``sampler.fcfs_decode_steps`` (a heap of end steps) equals the slot-by-slot host simulation above on random
  long-tail lengths, and gives the closed form when every request has the same length."""
  rng = np.random.default_rng(slots * 31 + cap)
  for n in (0, 1, 5, 200):
    lengths = np.minimum(rng.geometric(0.05, n), 64)
    assert smp.fcfs_decode_steps(lengths, slots, cap) == _scheduled_steps(lengths.tolist(), slots, cap), (n, lengths)
  # 12 requests of 5 tokens on 4 slots: three waves, each slot refilled the step after its last token
  assert smp.fcfs_decode_steps([5] * 12, 4, 16) == 15


def test_continuous_batching_matches_one_by_one(sparams):
  """slots=1 (one request at a time) == slots=4 (refilled as requests end) == slots=6 (all at once), bitwise, and
  with one refill per step; a free slot takes the next request on the very next decode step (inside the jitted loop).

  FP8 weights: the FP8 GEMM's rows do not depend on the batch (fixed K order, no split-K), so a request's tokens
  and log-probs do not depend on its neighbours. Long tail: 8 stop ids end completions at geometric lengths, with
  the max_new cap on the rest; requests = 3 prompts x 2 samples.
  """
  p = sparams["fp8"]
  rs = {(slots, 16): sampler(slots).generate(p, PROMPTS, SP, n=N) for slots in (1, 4, 6)}
  rs[4, 1] = sampler(4, refills=1).generate(p, PROMPTS, SP, n=N)
  lengths = rs[1, 16].lengths
  assert len(set(lengths.tolist())) >= 3, f"no long tail: lengths {lengths}"  # the test needs varied lengths
  assert np.any(rs[1, 16].finish_reason == smp.FINISH_STOP)
  for key, r in rs.items():
    for x in ("tokens", "logprobs", "lengths", "finish_reason"):
      np.testing.assert_array_equal(getattr(r, x), getattr(rs[1, 16], x), err_msg=f"{x}, (slots, refills)={key}")
    slots, cap = key
    steps = _scheduled_steps(lengths.tolist(), slots, cap)
    assert r.stats["decode_steps"] == steps, (key, r.stats["decode_steps"], steps)
    np.testing.assert_allclose(r.stats["mean_occupancy"], lengths.sum() / (steps * slots), rtol=1e-12)
    assert r.stats["occupancy_bound"] == r.stats["mean_occupancy"]  # the loop is the ideal schedule
    assert r.stats["generated_tokens"] == int(lengths.sum())


def test_prompt_pages_are_shared_by_the_samples(sparams):
  """The pool holds each prompt's pages once plus the slots' own pages (not n copies of every prompt): its size is
  the layout's, far below a dense (slots x max_len) cache plus a prompt cache."""
  s = sampler(4)
  r = s.generate(sparams["bf16"], PROMPTS, SP, n=N)
  lay = s.layout(len(PROMPTS), s.scfg.bucket(max(map(len, PROMPTS))), SP.max_new_tokens)
  page = kvcache.key_block()
  assert lay.page == page and lay.own_pages == min(lay.blocks, (SP.max_new_tokens - 1) // page + 2)
  assert r.stats["kv_pages"] == len(PROMPTS) * lay.prompt_pages + 4 * lay.own_pages
  heads, hd, _ = CFG.kv_cache_layout
  per_page = 2 * CFG.n_layers * page * heads * hd * 2  # K and V, BF16
  assert r.stats["kv_cache_bytes"] == r.stats["kv_pages"] * per_page
  dense = kvcache.cache_bytes(CFG.n_layers, 4, MAX_LEN, heads, hd, False) + \
      kvcache.cache_bytes(CFG.n_layers, len(PROMPTS), lay.prompt_pages * page, heads, hd, False)
  assert r.stats["kv_cache_bytes"] < dense


# ------------------------------------------------------------------------------------------------------------------
# Sampler log-probs vs trainer log-probs
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("recipe", ["bf16", "fp8"])
def test_sampler_logprobs_match_trainer(master, sparams, kv_scales, recipe, kv, record_property):
  """The sampler's log-probs are the trainer's forward's (mark_fp8 master params) bit for bit on CPU: the GEMMs and the
  attention reference run fixed-shape row tiles there, RMSNorm and the head's row sums one fixed order.

  With an FP8 KV cache the trainer applies the same K/V quantization (kv_scales). The alternative, BF16 attention
  in training against an FP8-KV rollout, is measured too: its mismatch must be larger (it is the one the identical
  quantization removes).
  """
  scales = kv_scales[recipe] if kv == "fp8" else None
  ro = sampler(4, kv).generate(sparams[recipe], PROMPTS, SP, n=N, kv_scales=scales)
  m = trainer_mismatch(master, RECIPES[recipe], ro, SP.temperature, kv_scales=scales)
  record_property("mismatch", m)
  print(f"\n{recipe} weights, {kv} KV: {m}")
  assert m["nonfinite_tokens"] == 0
  assert m["token_mult_prob_error"] == 1.0 and m["max_abs_logp_diff"] == 0.0, m
  if kv == "fp8":
    alt = trainer_mismatch(master, RECIPES[recipe], ro, SP.temperature, kv_scales=None)
    record_property("mismatch_bf16_attention_in_training", alt)
    print(f"{recipe} weights, fp8 KV rollout, BF16 attention in training: {alt}")
    assert alt["token_mult_prob_error"] > m["token_mult_prob_error"], (alt, m)
    assert alt["max_abs_logp_diff"] > 10 * max(m["max_abs_logp_diff"], 1e-6), (alt, m)


# ------------------------------------------------------------------------------------------------------------------
# FP8 KV cache
# ------------------------------------------------------------------------------------------------------------------


def test_fp8_kv_roundtrip_within_e4m3_bound():
  """|x - deq(q(x))| <= max(|x| 2^-4, scale 2^-10) with scale from the amax (margin 1): normals and subnormals."""
  key = jax.random.key(7)
  x = jax.random.normal(key, (3, 16, 2, 64), jnp.float32) * jnp.logspace(-4, 1, 64)  # spans the subnormal range
  x = x.astype(jnp.bfloat16)
  scale = kvcache.scales_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32)))[None], 1.0)[0]
  q = kvcache.quantize_kv(x, scale)
  assert q.dtype == quant.FP8_DTYPE
  deq = kvcache.dequantize_kv(q, scale, jnp.float32)
  err = np.abs(np.asarray(x, np.float32) - np.asarray(deq))
  bound = np.asarray(quant.roundtrip_bound(x, jnp.broadcast_to(scale, x.shape)))
  assert np.all(err <= bound), float(np.max(err / bound))
  # values beyond the calibrated range saturate at +-448 * scale (no inf/NaN)
  big = kvcache.dequantize_kv(kvcache.quantize_kv(jnp.array([1e6, -1e6]), scale), scale, jnp.float32)
  np.testing.assert_allclose(np.asarray(big), [448 * float(scale), -448 * float(scale)], rtol=1e-6)
  # kv_codes (trainer side) are the cache's codes; codes * scale has a straight-through (identity) gradient
  np.testing.assert_array_equal(np.asarray(kvcache.kv_codes(x, scale), np.float32), np.asarray(q, np.float32))
  g = jax.grad(lambda v: jnp.sum(kvcache.kv_codes(v, scale).astype(jnp.float32) * scale))(x.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(g), np.ones(x.shape, np.float32), rtol=1e-6)


def test_calibrated_kv_scales_are_finite_positive(kv_scales):
  for ks, vs in kv_scales.values():
    for s in (ks, vs):
      s = np.asarray(s)
      assert s.shape == (CFG.n_layers,) and np.all(np.isfinite(s)) and np.all(s > 0), s


# ------------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------------


class _SmallDevice:
  """A device with 1 MiB of memory (the sampler reads only memory_stats)."""

  platform = "cpu"

  def memory_stats(self):
    return {"bytes_limit": 2**20, "bytes_in_use": 0}

  def __str__(self):
    return "SmallDevice(1 MiB)"


def test_bad_configs_give_clear_errors(sparams, monkeypatch):
  p = sparams["bf16"]
  s = sampler(4)
  with pytest.raises(ValueError, match=r"rollout.max_len=64"):
    s.generate(p, [list(range(1, 65))], GREEDY)
  with pytest.raises(ValueError, match="at least one token"):
    s.generate(p, [[]], GREEDY)
  with pytest.raises(ValueError, match="needs kv_scales"):
    sampler(4, "fp8").generate(p, PROMPTS, GREEDY)
  with pytest.raises(ValueError, match=r"SamplerConfig.kv_cache \(fp8.kv_cache in a config\) must be one of .*'fp16'"):
    smp.SamplerConfig(kv_cache="fp16")
  with pytest.raises(ValueError, match="model.max_seq_len"):
    smp.Sampler(CFG, smp.SamplerConfig(max_len=CFG.max_seq_len + 1))
  with pytest.raises(ValueError, match="temperature"):
    smp.SamplingParams(temperature=0.0)
  with pytest.raises(ValueError, match="temperature"):
    smp.SamplingParams(temperature=-1.0)
  smp.SamplingParams(temperature=0.0, greedy=True)  # greedy ignores the temperature
  for top_p in (0.0, -0.1, 1.5):
    with pytest.raises(ValueError, match="top_p"):
      smp.SamplingParams(top_p=top_p)
  with pytest.raises(ValueError, match="max_new_tokens"):
    smp.SamplingParams(max_new_tokens=0)
  # a cache that does not fit: 64 slots x 2 own pages of 16 positions (12 new tokens) + 3 prompts x 2 pages = 134
  # pages x 16 x 2 layers x 2 heads x 64 x 2 (K, V) x 2 bytes = 2.1 MiB, with 1 MiB "free".
  monkeypatch.setattr(smp.jax, "local_devices", lambda *a: [_SmallDevice()])
  big = smp.Sampler(CFG, smp.SamplerConfig(slots=64, max_len=MAX_LEN))
  with pytest.raises(ValueError, match=r"KV cache needs 2.1 MiB \(134 pages .*rollout.slots=64.*SmallDevice"):
    big.generate(p, PROMPTS, GREEDY)
