"""Which ops on the log-prob path change a row's bits with the batch shape? (the exact-one-engine issue's hunt)

  PYTHONPATH=. python3 scripts/check_row_invariance.py [--out FILE.json] [--widths 1024:32768,4096:128256]
      [--m_decode 64,1] [--m_train 8192]

Each op of the model's log-prob path runs alone (its own jit, as fp8jax.jit compiles it) on a training-sized batch
of rows (--m_train, 8192: the trainer's tokens) and on decode-sized ones (--m_decode: M = 64 slots, and M = 1), the
small batches being rows of the large one. An op whose decode rows are not bitwise its training rows makes the sampler's log-probs
differ from the trainer's; the table says which, with the max |difference| and the fraction of rows that differ.
Shapes (--widths D:vocab): check_one_engine's (D 1024, vocab 32768) and Llama-3.1-8B's (D 4096, vocab 128256). Inside the real
steps XLA fuses ops with their neighbours, which can change the picture again; check_one_engine measures the whole.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax import attention as attn  # noqa: E402
from fp8jax import kvcache, ops, quant  # noqa: E402
from fp8jax import backends
from fp8jax.diagnostics.provenance import provenance  # noqa: E402
from fp8jax.model import head, layers  # noqa: E402
from fp8jax.model.config import ModelConfig  # noqa: E402

def _ops(d: int, vocab: int):
  """name -> (fn over row-batched arrays, list of per-row input shapes and dtypes) for one model width."""
  k = jax.random.key(d)
  norm_w = 1 + 0.1 * jax.random.normal(k, (d,), jnp.float32)
  head_w = (0.02 * jax.random.normal(jax.random.fold_in(k, 1), (vocab, d), jnp.float32)).astype(jnp.bfloat16)
  w_fp8 = quant.quantize_weight(0.02 * jax.random.normal(jax.random.fold_in(k, 2), (3 * d, d), jnp.float32))
  cfg = ModelConfig(vocab_size=vocab, dim=d, n_layers=1, n_heads=d // 128, n_kv_heads=max(1, d // 512),
                    head_dim=128, ffn_dim=4 * d, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192))
  inv = layers.rope_inv_freq(cfg)
  bf = jnp.bfloat16
  return {
      "rms_norm": (lambda x: layers.rms_norm(x, norm_w, 1e-5), [((d,), bf)]),
      "rope (positions as rows)": (lambda x, p: layers.apply_rope(x[:, None], p[:, None], inv)[:, 0],
                                   [((cfg.n_heads, 128), bf), ((), jnp.int32)]),
      "silu(gate) * up": (lambda g, u: (jax.nn.silu(g.astype(jnp.float32)).astype(bf) * u), [((4 * d,), bf)] * 2),
      "linear bf16 (lm_head)": (lambda x: ops.linear(x, head_w, ops.LinearConfig(out_dtype="float32")),
                                [((d,), bf)]),
      "linear fp8 (qkv-like)": (lambda x: ops.linear(x, w_fp8), [((d,), bf)]),
      "head: log p(token), entropy": (lambda x, t: jnp.stack(head.logprobs_and_entropy(head_w, x, t), -1),
                                       [((d,), bf), ((), jnp.int32)]),
      "head: logits, lse -> log p(token)": (lambda x, t: head.token_logprob(*head.logits_and_lse(head_w, x), t),
                                             [((d,), bf), ((), jnp.int32)]),
      "kv quantize (codes)": (lambda x: kvcache.quantize_kv(x, jnp.float32(0.01)), [((8, 128), bf)]),
  }


def _rand(key, shape, dtype, m, int_hi):
  if dtype == jnp.int32:  # token ids (< vocab) or positions (< 8192)
    return jax.random.randint(key, (m, *shape), 0, int_hi)
  return (jax.random.normal(key, (m, *shape), jnp.float32) * 2).astype(dtype)


def check(d: int, vocab: int, m_train: int, m_decode: tuple[int, ...]):
  rows = []
  for name, (fn, specs) in _ops(d, vocab).items():
    args = [_rand(jax.random.key(i), s, dt, m_train, vocab if "token" in name else 8192)
            for i, (s, dt) in enumerate(specs)]
    f = fp8jax.jit(fn)
    full = np.asarray(f(*args)).astype(np.float32)
    row = {"op": name, "d": d, "vocab": vocab}
    for m in m_decode:
      idx = np.random.default_rng(m).choice(m_train, m, replace=False)
      part = np.asarray(f(*[a[idx] for a in args])).astype(np.float32)
      diff = np.abs(part - full[idx])
      bad_rows = np.any(diff.reshape(m, -1) != 0, axis=1) if part.ndim > 1 else diff != 0
      row[f"m{m}_rows_differ"] = float(np.mean(bad_rows))
      row[f"m{m}_max_abs_diff"] = float(np.nanmax(diff)) if diff.size else 0.0
    rows.append(row)
    print(json.dumps(row), flush=True)
  rows.append(_sampler_vs_trainer_head(d, vocab, m_train, m_decode))
  print(json.dumps(rows[-1]), flush=True)
  return rows


def _sampler_vs_trainer_head(d: int, vocab: int, m_train: int, m_decode: tuple[int, ...]):
  """The one-engine question for the head itself: the sampler's log-prob (logits_and_lse + token_logprob) at
  decode M vs the trainer's (logprobs_and_entropy) at training M, for the same rows."""
  fns = _ops(d, vocab)
  train_fn, _ = fns["head: log p(token), entropy"]
  samp_fn, specs = fns["head: logits, lse -> log p(token)"]
  args = [_rand(jax.random.key(i), s, dt, m_train, vocab if dt == jnp.int32 else 0) for i, (s, dt) in
          enumerate(specs)]
  full = np.asarray(fp8jax.jit(train_fn)(*args))[:, 0]
  row = {"op": f"head: sampler (M) vs trainer ({m_train})", "d": d, "vocab": vocab}
  for m in m_decode:
    idx = np.random.default_rng(m).choice(m_train, m, replace=False)
    diff = np.abs(np.asarray(fp8jax.jit(samp_fn)(*[a[idx] for a in args])) - full[idx])
    row[f"m{m}_rows_differ"] = float(np.mean(diff != 0))
    row[f"m{m}_max_abs_diff"] = float(np.max(diff))
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="")
  ap.add_argument("--m_train", type=int, default=8192, help="rows of the training-sized batch")
  ap.add_argument("--widths", default="1024:32768,4096:128256", help="D:vocab pairs, comma-separated")
  ap.add_argument("--m_decode", default="64,1", help="decode-sized row counts, comma-separated")
  a = ap.parse_args()
  m_decode = tuple(int(m) for m in a.m_decode.split(","))
  rows = []
  for w in a.widths.split(","):
    d, vocab = (int(v) for v in w.split(":"))
    rows += check(d, vocab, a.m_train, m_decode)
  # attention: decode rows vs training rows (the op's own promise, for completeness)
  q = jax.random.normal(jax.random.key(0), (4, 700, 32, 128), jnp.bfloat16)
  kv = jax.random.normal(jax.random.key(1), (4, 700, 8, 128), jnp.bfloat16)
  train = np.asarray(fp8jax.jit(lambda q, k, v: attn.attend(q, k, v))(q, kv, kv))
  cache = jnp.zeros((4, kvcache.padded_len(700), 8, 128), jnp.bfloat16).at[:, :700].set(kv)
  ps = jnp.asarray([0, 100, 500, 699], jnp.int32)
  dec = np.asarray(fp8jax.jit(lambda q, k, v, p: attn.attend(q, k, v, p))(q[jnp.arange(4), ps][:, None], cache,
                                                                         cache, ps[:, None]))[:, 0]
  rows.append({"op": "attention (decode vs training, 4 rows)", "d": 4096, "vocab": 0, "m4_rows_differ": float(
      np.mean(np.any(dec != train[np.arange(4), np.asarray(ps)], axis=(1, 2))))})
  print(f"device: {jax.devices()[0].device_kind}; backends: {backends.backend_report()}")
  cols = [f"m{m}" for m in (*m_decode, 4)]
  print(f"{'op':38s} {'D':>5s} {'V':>7s} " + " ".join(f"{c + ' rows differ':>15s} {'max|diff|':>9s}" for c in cols))
  for r in rows:
    print(f"{r['op']:38s} {r['d']:5d} {r.get('vocab', 0):7d} " + " ".join(
        f"{r.get(c + '_rows_differ', float('nan')):15.3f} {r.get(c + '_max_abs_diff', float('nan')):9.2e}"
        for c in cols))
  if a.out:
    with open(a.out, "w") as f:
      json.dump({**provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
