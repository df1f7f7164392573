"""Imported by pytest before any test module: fp8jax must come before jax so its XLA flags apply (fp8jax/__init__)."""

import fp8jax  # noqa: F401
