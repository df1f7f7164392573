"""The chunked output head (fp8jax.model.head) vs whole-row jax.nn.log_softmax, its gradients, its memory, and the
sampler's view vs the trainer's."""

import fp8jax  # noqa: F401  (first: XLA flags)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import ops, quant

from fp8jax import backends
from fp8jax.model import head

CHUNK = 256
V, D, N = 3 * CHUNK + 128 + 40, 128, 33  # three full chunks and a ragged remainder (not a multiple of 128)
TEMP = 0.7
LIN = ops.LinearConfig()


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
  monkeypatch.setattr(head, "VOCAB_CHUNK", CHUNK)


def _inputs(seed=0, v=V, n=N):
  k = jax.random.key(seed)
  w = 0.5 * jax.random.normal(k, (v, D), jnp.float32)
  h = jax.random.normal(jax.random.fold_in(k, 1), (n, D), jnp.float32).astype(jnp.bfloat16)
  t = jax.random.randint(jax.random.fold_in(k, 2), (n,), 0, v)
  return w, h, t


def _weights(w):
  return {"bf16": w.astype(jnp.bfloat16), "fp8_master": quant.FP8Weight(w), "fp8_frozen": quant.quantize_weight(w)}


def _trainer(w, h, t):
  return fp8jax.jit(head.logprobs_and_entropy, static_argnums=(3, 4))(w, h, t, LIN, TEMP)


def _sampler(w, h, t):
  def f(w, h, t):
    lg, lse = head.logits_and_lse(w, h, LIN, TEMP)
    return head.token_logprob(lg, lse, t, TEMP), lg
  return fp8jax.jit(f)(w, h, t)


@pytest.mark.parametrize("kind", ["bf16", "fp8_master", "fp8_frozen"])
def test_matches_whole_row_log_softmax(kind):
  w, h, t = _inputs()
  wt = _weights(w)[kind]
  lp, ent = _trainer(wt, h, t)
  whole = ops.linear(h, wt, ops.LinearConfig(out_dtype="float32"))  # one GEMM over all V columns
  ref_lp, ref_ent = head.reference_logprobs_and_entropy(whole, t, TEMP)
  # FP32 rounding of a different summation order only: lse and the entropy (lse - E_p[z]) are differences of terms
  # up to the largest scaled logit (~38 here), so a few of its ulps (8: ~4e-5; seen 2.4 on an Intel Xeon for the
  # entropy of a peaked row, 0.004, where the two terms cancel)
  tol = 8 * np.finfo(np.float32).eps * float(jnp.abs(whole).max()) / TEMP
  np.testing.assert_allclose(lp, ref_lp, atol=tol, rtol=0)
  np.testing.assert_allclose(ent, ref_ent, atol=tol, rtol=0)
  lp_s, lg = _sampler(wt, h, t)
  np.testing.assert_allclose(lg, whole, atol=1e-5, rtol=1e-6)
  assert lg.shape == (N, V)
  np.testing.assert_allclose(lp_s, lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("v", [40, CHUNK, 2 * CHUNK])
def test_vocab_smaller_than_or_equal_to_chunks(v):
  w, h, t = _inputs(1, v=v)
  lp, ent = _trainer(w.astype(jnp.bfloat16), h, t)
  ref_lp, ref_ent = head.reference_logprobs_and_entropy(ops.linear(h, w.astype(jnp.bfloat16),
                                                                   ops.LinearConfig(out_dtype="float32")), t, TEMP)
  np.testing.assert_allclose(lp, ref_lp, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["bf16", "fp8_master", "fp8_frozen"])
def test_rows_do_not_depend_on_the_batch(kind):
  """A row's log-prob and entropy among 33 rows vs alone vs among 3. On CPU only to FP32 rounding: XLA:CPU's row
  reductions change their order with the row count (by ~1 ulp; the whole-row jax.nn.log_softmax does too), which is
  why the CPU sampler-vs-trainer bound is 1 + 1e-5. The GPU twin below asserts bits."""
  w, h, t = _inputs(2)
  wt = _weights(w)[kind]
  lp, ent = _trainer(wt, h, t)
  for rows in ([0], [5, 17, 32]):
    lp_r, ent_r = _trainer(wt, h[jnp.asarray(rows)], t[jnp.asarray(rows)])
    np.testing.assert_allclose(lp_r, lp[jnp.asarray(rows)], atol=1e-5, rtol=0)
    np.testing.assert_allclose(ent_r, ent[jnp.asarray(rows)], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["bf16", "fp8_frozen"])
def test_whole_vocab_path_matches_chunks(kind, monkeypatch):
  """The sampler's one-GEMM path (``whole_vocab_gemm``; on CPU forced here, where it is off) takes each chunk's
  statistics from the right columns: its logits, log-probs and logsumexp agree with the chunked path's (to FP32
  rounding on XLA:CPU, whose matmul blocking follows N; the GPU twin below asserts bits)."""
  w, h, t = _inputs(5)
  wt = _weights(w)[kind]
  assert not head.whole_vocab_gemm(wt, LIN)  # CPU: the reference GEMMs, chunked

  def run():
    lg, lse = fp8jax.jit(lambda w_, h_: head.logits_and_lse(w_, h_, LIN, TEMP))(wt, h)
    return lg, lse, head.token_logprob(lg, lse, t, TEMP)

  chunked = run()
  monkeypatch.setattr(head, "whole_vocab_gemm", lambda *_: True)
  whole = run()
  assert whole[0].shape == (N, V)
  for a, b in zip(whole, chunked):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not backends.hopper_available(), reason="needs an sm_90 GPU (the invariant Pallas GEMM)")
@pytest.mark.parametrize("kind", ["bf16", "fp8_master", "fp8_frozen"])
def test_gpu_sampler_rows_are_trainer_rows(kind, monkeypatch):
  """On Hopper, with the head on the batch-invariant kernels: the sampler's log-prob of a row at decode sizes
  (1, 64 rows) is bitwise the trainer's at a training size (4096 rows), at a real vocabulary and chunk size; the
  sampler's logits from one whole-vocabulary GEMM are bitwise its chunked GEMMs'."""
  monkeypatch.setattr(head, "VOCAB_CHUNK", 8192)
  k = jax.random.key(11)
  v, d, n = 32768 + 640, 1024, 4096
  w = 0.02 * jax.random.normal(k, (v, d), jnp.float32)
  wt = _weights(w)[kind]
  assert head.whole_vocab_gemm(wt, LIN)
  h = jax.random.normal(jax.random.fold_in(k, 1), (n, d), jnp.float32).astype(jnp.bfloat16)
  t = jax.random.randint(jax.random.fold_in(k, 2), (n,), 0, v)
  lp, ent = _trainer(wt, h, t)
  whole = {}
  for m in (1, 64):
    idx = jnp.asarray(np.random.default_rng(m).choice(n, m, replace=False))
    lp_t, ent_t = _trainer(wt, h[idx], t[idx])
    np.testing.assert_array_equal(lp_t, lp[idx])
    np.testing.assert_array_equal(ent_t, ent[idx])
    whole[m] = _sampler(wt, h[idx], t[idx])
    np.testing.assert_array_equal(whole[m][0], lp[idx])
  monkeypatch.setattr(head, "whole_vocab_gemm", lambda *_: False)
  for m in (1, 64):
    idx = jnp.asarray(np.random.default_rng(m).choice(n, m, replace=False))
    lp_c, lg_c = _sampler(wt, h[idx], t[idx])
    np.testing.assert_array_equal(whole[m][1], lg_c)
    np.testing.assert_array_equal(whole[m][0], lp_c)


@pytest.mark.parametrize("kind", ["bf16", "fp8_master"])
def test_gradients_match_whole_row_reference(kind):
  w, h, t = _inputs(3)
  wt = _weights(w)[kind]
  a = jax.random.normal(jax.random.key(9), (N,))

  def loss(fn):
    def f(w_, h_):
      lp, ent = fn(w_, h_)
      return jnp.sum(lp * a) + 0.3 * jnp.sum(ent)
    return jax.jit(jax.grad(f, argnums=(0, 1)))

  got = loss(lambda w_, h_: head.logprobs_and_entropy(w_, h_, t, LIN, TEMP))(wt, h)
  want = loss(lambda w_, h_: head.reference_logprobs_and_entropy(
      ops.linear(h_, w_, ops.LinearConfig(out_dtype="float32")), t, TEMP))(wt, h)
  (gw, gh), (rw, rh) = [(jax.tree.leaves(g[0])[0], g[1]) for g in (got, want)]
  # Gradients come in their operand's dtype: dW FP32 for the FP8 master (the same per-chunk terms: FP32 rounding),
  # BF16 for a BF16 weight, dh BF16 (h's dtype): a different FP32 summation order then moves ~1 BF16 ulp.
  for g, r in ((gw, rw), (gh, rh)):
    tol = 1e-5 if g.dtype == jnp.float32 else 2 ** -7
    r32 = np.asarray(r, np.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), r32, atol=tol * float(np.max(np.abs(r32))), rtol=0)


def test_gradient_frozen_weight_reaches_hidden_only():
  w, h, t = _inputs(4)
  qw = quant.quantize_weight(w)
  gh = jax.grad(lambda h_: jnp.sum(head.logprobs_and_entropy(qw, h_, t, LIN, TEMP)[0]))(h)
  rh = jax.grad(lambda h_: jnp.sum(head.reference_logprobs_and_entropy(
      ops.linear(h_, qw, ops.LinearConfig(out_dtype="float32")), t, TEMP)[0]))(h)
  np.testing.assert_allclose(np.asarray(gh, np.float32), np.asarray(rh, np.float32),
                             atol=2 ** -7 * float(jnp.max(jnp.abs(rh.astype(jnp.float32)))), rtol=0)


def test_training_never_holds_the_logits():
  """Forward + backward temporaries stay far below one (N, V) FP32 tensor (the unchunked head holds several)."""
  v, n = 32 * CHUNK, 512
  w, h, t = _inputs(5, v=v, n=n)

  def step(fn):
    return jax.jit(jax.grad(lambda w_, h_: jnp.sum(fn(w_, h_)[0]), argnums=(0, 1))).lower(
        w.astype(jnp.bfloat16), h).compile().memory_analysis().temp_size_in_bytes

  chunked = step(lambda w_, h_: head.logprobs_and_entropy(w_, h_, t, LIN, TEMP))
  whole = step(lambda w_, h_: head.reference_logprobs_and_entropy(
      ops.linear(h_, w_, ops.LinearConfig(out_dtype="float32")), t, TEMP))
  logits_bytes = n * v * 4
  assert whole >= logits_bytes, (whole, logits_bytes)  # the reference's (N, V) tensors are really there
  assert chunked < logits_bytes / 4, (chunked, logits_bytes)
