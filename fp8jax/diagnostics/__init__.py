"""Checks and harnesses that measure the library, never imported by it (tests/test_imports.py checks that).

* ``one_engine``: the sampler's arithmetic vs the trainer's, whole (``sampler_vs_trainer``) and block by block
  (``block_divergence``); run by scripts/check_one_engine.py, scripts/check_layer_divergence.py and the tests.
* ``parity``: accuracy parity of the GRPO arms (BF16, FP8 end to end, FP8 in generation only) from one warm start;
  run by scripts/parity.py (docs/parity.md).
* ``sensitivity``: the FP8 recipe's KL and top-1 vs BF16 on a real model, per layer and per kind of linear kept in
  BF16; run by scripts/fp8_sensitivity.py (docs/fp8_sensitivity.md).
"""
