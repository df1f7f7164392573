"""The decode-slot occupancy a long-tail rollout workload allows, whatever the sampler (issue 16's "occupancy >= 0.9").

  python3 scripts/occupancy_bound.py [--requests 2048,4096,8192,16384] [--slots 256] [--max_new 512]
      [--stop_prob 0.0078125] [--refills 16] [--seeds 50] [--out FILE.json]

Completion lengths are drawn as in ``scripts/bench_rollout.py``'s long-tail workload: each generated token is a stop
token with probability ``--stop_prob`` (its stop set is ~vocab * 4 / max_new ids under near-uniform logits, so ~4 /
max_new), capped at ``--max_new``. For each seed the lengths run through the ideal first-come-first-served schedule
(``fp8jax.sampler.fcfs_decode_steps``: a freed slot takes the next request on the very next step, at most
``--refills`` per step); occupancy = tokens / (steps x slots). The sampler's decode loop is this schedule (its step
count is tested against it), and with lengths unknown in advance no admission order does better in expectation, so
this is the bound for the workload: what raises it is a deeper queue (more requests per slot), not the sampler.
Pure host code; a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from fp8jax.diagnostics.provenance import provenance
from fp8jax.sampler import fcfs_decode_steps


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--requests", default="2048,4096,8192,16384", help="comma-separated request counts")
  p.add_argument("--slots", type=int, default=256)
  p.add_argument("--max_new", type=int, default=512)
  p.add_argument("--stop_prob", type=float, default=1002 / 128256,
                 help="per-token stop probability (default: bench_rollout's long tail at Llama's vocab, max_new 512)")
  p.add_argument("--refills", type=int, default=16, help="rollout.max_refills_per_step")
  p.add_argument("--seeds", type=int, default=50)
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  rows = []
  for n in (int(x) for x in a.requests.split(",")):
    occ, steps = [], []
    for seed in range(a.seeds):
      lengths = np.minimum(np.random.default_rng(seed).geometric(a.stop_prob, n), a.max_new)
      st = fcfs_decode_steps(lengths, a.slots, a.refills)
      occ.append(lengths.sum() / (st * a.slots))
      steps.append(st)
    rows.append(dict(requests=n, requests_per_slot=n / a.slots, occupancy_mean=float(np.mean(occ)),
                     occupancy_p5=float(np.percentile(occ, 5)), occupancy_p95=float(np.percentile(occ, 95)),
                     steps_mean=float(np.mean(steps))))
  print(f"slots {a.slots}, max_new {a.max_new}, stop prob {a.stop_prob:.5f}, refills/step {a.refills}, {a.seeds} seeds")
  print("| requests | per slot | occupancy bound (mean) | p5 - p95 | decode steps |\n|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['requests']} | {r['requests_per_slot']:.0f} | {r['occupancy_mean']:.3f} | {r['occupancy_p5']:.3f} - "
          f"{r['occupancy_p95']:.3f} | {r['steps_mean']:.0f} |")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(dict(**provenance(), args=vars(a), rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
