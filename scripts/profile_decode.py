"""Runs the decode attention kernel alone, for a profiler (Nsight Compute) to catch one launch.

  PYTHONPATH=. python3 scripts/profile_decode.py --kv fp8 [--slots 256 --max_len 1536 --mean_ctx 1024] [--iters 3]
  ncu --clock-control none --kernel-name regex:attention_decode --launch-skip 1 --launch-count 1 --set full \
      -o decode_fp8 python3 scripts/profile_decode.py --kv fp8

The operands are bench_attention.py's decode rows (one layer of a 256-slot cache with ragged lengths, 32 query /
8 key-value heads, head_dim 128, random values): the same launch the benchmark times, here without the timing
harness so the profiler sees only the kernel (and the operand-building XLA kernels, which its name filter skips).
Prints the CUPTI-free wall time per launch (synchronized, median) as a sanity check, not as a figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_attention's operands

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_attention import decode_operands  # noqa: E402
from fp8jax import attention as attn  # noqa: E402


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--kv", choices=("fp8", "bf16"), default="fp8")
  p.add_argument("--slots", type=int, default=256)
  p.add_argument("--max_len", type=int, default=1536)
  p.add_argument("--mean_ctx", type=int, default=1024)
  p.add_argument("--iters", type=int, default=3)
  a = p.parse_args()
  q, ck, cv, pos, scale, live = decode_operands(a.kv == "fp8", a.slots, a.max_len, a.mean_ctx, key=jax.random.key(1))

  @jax.jit
  def step(q, ck, cv, pos):
    return attn.attend(q[:, None], ck, cv, pos[:, None], k_scale=scale, v_scale=scale, backend="pallas")[:, 0]

  times = []
  for _ in range(a.iters):
    t0 = time.perf_counter()
    out = step(q, ck, cv, pos).block_until_ready()
    times.append(time.perf_counter() - t0)
  ms = statistics.median(times[1:] or times) * 1e3
  print(f"decode {a.kv}: {ms:.3f} ms per launch (wall, synchronized), live K/V {live / 1e9:.3f} GB, "
        f"finite {bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))}", flush=True)


if __name__ == "__main__":
  main()
