"""The paged KV cache write kernel (pallas_kernels/kv_write.py) against its reference, ``fp8jax.kvcache.store``:
the same pool contents bit for bit (BF16 and FP8 pools, decode and prefill rows, dropped positions, stale NaN pages
left alone), in interpret mode on CPU, lowered for CUDA, and compiled on a GPU."""

import fp8jax  # noqa: F401  (first: XLA flags)

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import attention as attn
from fp8jax import kvcache as kvc
from fp8jax import quant
from fp8jax import recipes
from fp8jax import sampler as smp
from fp8jax.model import gqa, llama
from fp8jax.model.config import ModelConfig
from pallas_kernels import kv_write
from pallas_kernels.lowering import lower_for_h200

PAGE, H, D = 16, 4, 64


def _case(seed: int, b: int, t: int, fp8: bool, n_pages: int = 24, blocks: int = 4, layers: int = 3):
  """A paged cache of ``layers`` pools of random pages (some NaN: stale), a page table of distinct pages, new K/V
  rows and their positions (distinct within a row, as a sequence's are): in range, negative (a padding row) and
  past the table's last block (both dropped)."""
  rng = np.random.default_rng(seed)
  shape = (n_pages, PAGE, H, D)
  pools = []
  for _ in range(2 * layers):
    x = rng.standard_normal(shape).astype(np.float32) * 3
    x[rng.integers(0, n_pages, 3)] = np.nan
    pools.append(jnp.asarray(x).astype(quant.FP8_DTYPE if fp8 else jnp.bfloat16))
  table = jnp.asarray(rng.permutation(n_pages)[:b * blocks].reshape(b, blocks), jnp.int32)
  pos = np.stack([rng.permutation(blocks * PAGE)[:t] for _ in range(b)])
  pos[0, 0], pos[-1, -1] = -1, blocks * PAGE + 3
  # amax 40 with scales for amax ~8: values saturate at +-448, the small ones go subnormal
  new = [jnp.asarray(rng.standard_normal((b, t, H, D)) * 10, jnp.bfloat16) for _ in range(2)]
  # a BF16 cache holds ones, as kvcache.init_cache makes them
  scales = [jnp.asarray(rng.uniform(4, 12, layers) / 448 if fp8 else np.ones(layers), jnp.float32) for _ in range(2)]
  cache = kvc.KVCache(k=pools[:layers], v=pools[layers:], k_scale_L=scales[0], v_scale_L=scales[1],
                      page_table=table)
  return cache, new, jnp.asarray(pos, jnp.int32)


def _bits(x):
  return np.asarray(x).view(np.uint8 if x.dtype.itemsize == 1 else np.uint16)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("b,t", [(6, 1), (3, 5)], ids=["decode", "prefill"])
def test_kernel_interpret_equals_store_bitwise(fp8, b, t, monkeypatch):
  """Every layer's pools (layer 1 reads its own scales from the (L,) arrays) are the two scatters'."""
  monkeypatch.setattr(kv_write, "paged_write", functools.partial(kv_write.paged_write, interpret=True))
  cache, (kn, vn), pos = _case(b * 7 + t, b, t, fp8)
  for layer in range(len(cache.k)):
    want = kvc.store_layer(cache, layer, kn, vn, pos)
    got = kvc.store_layer(cache, layer, kn, vn, pos, kernel=True)
    for g, w, old in zip(got, want, (cache.k[layer], cache.v[layer])):
      np.testing.assert_array_equal(_bits(g), _bits(w))
      assert not np.array_equal(_bits(g), _bits(old))  # something was written


def test_kernel_path_in_a_jitted_loop_equals_scatters(monkeypatch):
  """The kernel inside a jitted loop carrying the pools, as the sampler's decode runs it: every step's pools are
  the two scatters'."""
  monkeypatch.setattr(kv_write, "paged_write", functools.partial(kv_write.paged_write, interpret=True))
  cache, _, _ = _case(3, 4, 1, True)
  key = jax.random.key(0)

  def loop(kernel):
    def step(i, c):
      new = jax.random.normal(jax.random.fold_in(key, i), (2, 4, 1, H, D), jnp.bfloat16) * 4
      pos = jnp.full((4, 1), i, jnp.int32) + jnp.arange(4, dtype=jnp.int32)[:, None] * 9
      k, v = kvc.store_layer(dataclasses.replace(cache, k=[cache.k[0], c[0]], v=[cache.v[0], c[1]]), 1, new[0],
                             new[1], pos, kernel=kernel)
      return k, v
    return jax.jit(lambda k, v: jax.lax.fori_loop(0, 5, step, (k, v)))(cache.k[1], cache.v[1])

  for g, w in zip(loop(True), loop(False)):
    np.testing.assert_array_equal(_bits(g), _bits(w))


def _fp8_sampler_run(params_seed: int, sampling_seed: int):
  """-> run(decode_chunk): a small model's sampler with an FP8 paged cache (3 slots, 3 prompts x 2 samples: refills
  inside the decode loop) generating with fixed KV scales. Each decode_chunk compiles new programs (jit caches key
  on the sampler's configs); the results do not depend on it."""
  cfg = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256)
  params = smp.prepare_params(llama.init_params(cfg, seed=params_seed, std=0.1), recipes.Recipe())
  scfg = smp.SamplerConfig(slots=3, max_len=48, kv_cache="fp8", decode_chunk=4)
  prompts = [[1, 2, 3], list(range(5, 25)), [7] * 9]
  sp = smp.SamplingParams(temperature=1.0, max_new_tokens=10, seed=sampling_seed)
  scales = (jnp.asarray([0.02, 0.03]), jnp.asarray([0.025, 0.015]))
  return lambda decode_chunk: smp.Sampler(cfg, dataclasses.replace(scfg, decode_chunk=decode_chunk)).generate(
      params, prompts, sp, n=2, kv_scales=scales)


def _assert_same_samples(got, want):
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.logprobs, want.logprobs)
  np.testing.assert_array_equal(got.lengths, want.lengths)


def test_sampler_with_the_write_kernel_equals_scatters(monkeypatch):
  """The sampler with the write kernel (interpret mode; ``gqa`` picks it as on a GPU): prefill, the jitted decode
  loop and its refills (6 requests on 3 slots), FP8 KV cache: the scatter path's tokens and log-probs exactly."""
  run = _fp8_sampler_run(1, 3)
  want = run(4)
  calls, kernel = [], kv_write.paged_write

  def interpreted(*args, **kwargs):
    calls.append(1)
    return kernel(*args, interpret=True, **kwargs)

  monkeypatch.setattr(kv_write, "paged_write", interpreted)
  monkeypatch.setattr(gqa, "_write_kernel", lambda cfg, lcfg, q, pool, k, page_table: page_table is not None)
  got = run(5)  # another decode_chunk: new programs, which trace the kernel path
  assert calls  # the kernel path was traced
  assert want.stats["decode_steps"] > 10  # refills happened inside the loop
  _assert_same_samples(got, want)


@pytest.mark.parametrize("kernel", [False, True], ids=["scatters", "kernel"])
def test_pair_ordered_cache_stores_head_dims_in_pair_order(kernel, monkeypatch):
  """A pair-ordered FP8 cache (``KVCache.pair_ordered``) receives each new row's codes with its head dims in pair
  order: the natural cache's pages with ``pallas_kernels.attention.pair_order`` applied to the written rows, through
  the scatters and through the write kernel; pages it does not write stay as they were."""
  from pallas_kernels import attention as ref  # noqa: PLC0415
  monkeypatch.setattr(kv_write, "paged_write", functools.partial(kv_write.paged_write, interpret=True))
  cache, (k, v), pos = _case(7, 3, 5, True)
  po = dataclasses.replace(cache, pair_ordered=True)
  for layer in range(2):
    nk, nv = kvc.store_layer(cache, layer, k, v, pos, kernel=kernel)
    pk, pv = kvc.store_layer(po, layer, k, v, pos, kernel=kernel)
    written = np.zeros(cache.k[0].shape[:2], bool)
    page, off = kvc._page_offsets(cache.k[0], pos, cache.page_table)
    ok = np.asarray(page) < written.shape[0]
    written[np.asarray(page)[ok], np.asarray(off)[ok]] = True
    for got, nat, old in ((pk, nk, cache.k[layer]), (pv, nv, cache.v[layer])):
      np.testing.assert_array_equal(_bits(got)[written], _bits(ref.pair_order(nat))[written])
      np.testing.assert_array_equal(_bits(got)[~written], _bits(old)[~written])


def test_sampler_with_a_pair_ordered_cache_equals_natural(monkeypatch):
  """The sampler with its FP8 cache in pair order (as on a GPU with the attention kernels; here the reference
  attention reads it back in natural order): prefill, the decode loop with refills: the natural cache's tokens and
  log-probs exactly, and the cache it attends over is pair-ordered."""
  run = _fp8_sampler_run(2, 4)
  want = run(4)
  seen, attend = [], attn.attend

  def spy(*args, pair_ordered=False, **kwargs):
    seen.append(pair_ordered)
    return attend(*args, pair_ordered=pair_ordered, **kwargs)

  monkeypatch.setattr(smp.Sampler, "_pair_ordered", lambda self, kv_cache: kv_cache == "fp8")
  monkeypatch.setattr(attn, "attend", spy)
  jax.clear_caches()  # retrace: an earlier test may have compiled the same step (the spy sees traces only)
  got = run(5)
  assert seen and all(seen)
  _assert_same_samples(got, want)


def test_bad_operands_are_named():
  cache, (kn, vn), pos = _case(1, 2, 1, True)
  page, off = kvc._page_offsets(cache.k[0], pos, cache.page_table)
  args = (cache.k[0], cache.v[0], kn[:, 0], vn[:, 0])
  with pytest.raises(ValueError, match="FP8 pool needs k_scale_L"):
    kv_write.paged_write(*args, page[:, 0], off[:, 0], interpret=True)
  with pytest.raises(ValueError, match="holding layer 5"):
    kv_write.paged_write(*args, page[:, 0], off[:, 0], cache.k_scale_L, cache.v_scale_L, layer=5, interpret=True)
  with pytest.raises(ValueError, match="one page and offset per new row"):
    kv_write.paged_write(*args, page[:1, 0], off[:1, 0], cache.k_scale_L, cache.v_scale_L, interpret=True)
  assert "powers of two" in kv_write.unsupported(jnp.zeros((4, 16, 3, 64)), jnp.zeros((1, 3, 64)))


def test_kernel_lowers_for_cuda():
  S = jax.ShapeDtypeStruct
  pool = S((2368, 128, 8, 128), quant.FP8_DTYPE)
  new, idx, scales = S((256, 8, 128), jnp.bfloat16), S((256,), jnp.int32), S((32,), jnp.float32)
  for pair_ordered in (False, True):
    fn = functools.partial(kv_write.paged_write, layer=7, pair_ordered=pair_ordered)
    text = lower_for_h200(fn, pool, pool, new, new, idx, idx, scales, scales)
    assert "triton" in text and "fp8jax_kv_write" in text


@pytest.mark.gpu
@pytest.mark.skipif(not attn._gpu_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8,pair_ordered", [(False, False), (True, False), (True, True)],
                         ids=["bf16", "fp8", "fp8_pair_ordered"])
def test_gpu_kernel_equals_store_bitwise(fp8, pair_ordered):
  """Compiled (native E4M3 cast; strided stores for a pair-ordered pool): bitwise the XLA scatters, at a decode
  step's and a prefill's rows."""
  for b, t in ((64, 1), (4, 33)):
    cache, (kn, vn), pos = _case(b + t, b, t, fp8, n_pages=4 * b + 8)
    cache = dataclasses.replace(cache, pair_ordered=pair_ordered)
    for layer in (0, 2):
      want = jax.jit(lambda c: kvc.store_layer(c, layer, kn, vn, pos))(cache)
      got = jax.jit(lambda c: kvc.store_layer(c, layer, kn, vn, pos, kernel=True))(cache)
      for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"b={b} t={t} layer={layer}")
