"""The sampler's per-step sampling cost at the rollout's decode size, and what a cheaper RNG would save (issue 16).

  PYTHONPATH=. python3 scripts/bench_sampling.py [--rows 256] [--vocab 128256] [--out DIR]

Times, on one decode step's logits (rows x vocab FP32, temperature 1, no top-k / top-p), with CUPTI kernel times
(``bench_gemm.jax_time_ms``, median of 10):
  threefry   ``sampler.sample_tokens`` as the sampler runs it: per-row keys fold_in(fold_in(key(seed), request),
             position), then ``jax.random.categorical`` (threefry bits, Gumbel-max)
  hash       Gumbel-max over a counter-based hash of (seed, request, position, vocab index) (two MurmurHash3 fmix32
             per logit: the alternative tried in commit 5fa7b07 and reverted; kept here only to price it)
  argmax     the argmax alone (greedy; the floor of any sampler that reads every logit)
Prints a table, writes bench_sampling.json to --out.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_gemm import jax_time_ms  # noqa: E402
from fp8jax import sampler as smp  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402


def _fmix32(x):
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def hash_uniforms(seed, request_B, position_B, vocab: int):
  """(B, vocab) uniforms in (0, 1) from a hash of (seed, request, position, vocab index)."""
  s = jnp.asarray(seed, jnp.uint32)
  r, i = request_B.astype(jnp.uint32), position_B.astype(jnp.uint32)
  k1 = _fmix32(_fmix32(_fmix32(s ^ jnp.uint32(0x243F6A88)) + r) + i)
  k2 = _fmix32(_fmix32(_fmix32(s ^ jnp.uint32(0x85A308D3)) ^ i) + r * jnp.uint32(0x9E3779B9))
  v = jnp.arange(vocab, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
  x = _fmix32(_fmix32(k1[:, None] + v[None, :]) ^ k2[:, None])
  return ((x >> 9).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-23)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=128256)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  a = ap.parse_args()
  logits = jax.random.normal(jax.random.key(0), (a.rows, a.vocab), jnp.float32)
  req, pos = jnp.arange(a.rows, dtype=jnp.int32), jnp.full((a.rows,), 700, jnp.int32)
  sp, base = smp.SamplingParams(), jax.random.key(1)

  def threefry(lg, r, i):
    keys = jax.vmap(lambda rr, ii: jax.random.fold_in(jax.random.fold_in(base, rr), ii))(r, i)
    return smp.sample_tokens(keys, lg, sp)

  def hashed(lg, r, i):
    l = smp.filter_logits(lg, sp.temperature, sp.top_k, sp.top_p)
    return jnp.argmax(l - jnp.log(-jnp.log(hash_uniforms(7, r, i, a.vocab))), axis=-1).astype(jnp.int32)

  def argmax(lg, r, i):
    return jnp.argmax(lg, axis=-1).astype(jnp.int32)

  res = {name: jax_time_ms(f, [(logits, req, pos)], iters=10)[0]
         for name, f in (("threefry", threefry), ("hash", hashed), ("argmax", argmax))}
  with open(os.path.join(a.out, "bench_sampling.json"), "w") as f:
    json.dump({**provenance(), "args": vars(a),
               "ms": res}, f, indent=1)
  print(f"\n| sampler ({a.rows} x {a.vocab} logits) | us per decode step |\n|---|---|")
  for name, ms in res.items():
    print(f"| {name} | {ms * 1e3:.1f} |")


if __name__ == "__main__":
  main()
