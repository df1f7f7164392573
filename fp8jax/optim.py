"""Adam with its moments stored in a narrower dtype than the FP32 master (``optim.state_dtype``), and where the
optimizer state lives (``optim.offload``).

Why: full-parameter training of an 8B model holds 4 bytes of FP32 master, 4 of gradient accumulator and 8 of Adam
moments per parameter (128 GB). Storing both moments in BF16 saves 4 bytes per parameter (32 GB at 8B) and keeps
every arithmetic operation of the update in FP32.

``scale_by_adam_stored(b1, b2, eps, state_dtype)`` is an optax ``GradientTransformation`` (``ScaleByAdamState``: a
step count, ``mu``, ``nu``) whose update step t is, per element, with ``g`` the (FP32) gradient:

  m = (1 - b1) * g + b1 * f32(mu_{t-1})            FP32 (f32(): the exact widening of the stored value)
  v = (1 - b2) * g**2 + b2 * f32(nu_{t-1})         FP32
  update = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)     FP32, from the unrounded m and v
  mu_t = round(m), nu_t = round(v)                  stored in ``state_dtype``

``round`` is ``astype``: IEEE round-to-nearest-even. For BF16 (8 significant bits, FP32's exponent range) a stored
moment differs from its FP32 value by at most 2**-8 of its magnitude (normal numbers; below 2**-126 by at most
2**-134, half BF16's subnormal spacing), once per step; the step's own update uses the unrounded values, so step 1
equals FP32 Adam bit for bit, and the difference in later steps is that of the moments it starts from: with
e_t = mu_t - m_t^{FP32}, |e_t| <= b1 |e_{t-1}| + 2**-8 |m_t| (likewise nu with b2) - the bound tests/test_optim.py
checks against optax's FP32 Adam. With ``state_dtype="float32"`` the expressions are optax.scale_by_adam's own
(optax.tree's moment and bias-correction helpers), so the result is optax's bit for bit; ``make_optimizer`` keeps
``optax.adamw`` itself for that default.

Why not ``optax.adam(mu_dtype=jnp.bfloat16)`` (optax 0.2.8): it stores the first moment only in BF16 (``nu`` keeps
the params' FP32: half the saving), and computes ``b1 * mu`` as a BF16 product (a Python float times a BF16 array
stays BF16 under JAX's weak typing) before the FP32 add: one more rounding per step, not of FP32 math.

Offload (``optim.offload="pinned_host"``) is a placement, not other arithmetic: the learner keeps the FP32 master
and the optimizer state in the host's pinned memory between steps (``Learner.state_shardings``), and the train step
moves them to the device inside the step (``to_device``), the moments only for the update. ``check_offload`` refuses
a backend without that memory kind, naming the key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

STATE_DTYPES = ("float32", "bfloat16")
OFFLOADS = ("none", "pinned_host")


def scale_by_adam_stored(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                         state_dtype: str = "float32") -> optax.GradientTransformation:
  """Adam's scaling (``optax.scale_by_adam``'s math in FP32) with ``mu`` and ``nu`` stored as ``state_dtype``
  (module docstring: the rounding). The count is int32, as optax's."""
  dtype = jnp.dtype(state_dtype)

  def init_fn(params):
    zeros = lambda p: jnp.zeros(jnp.shape(p), dtype)  # noqa: E731
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                                  nu=jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    del params
    widen = lambda t: t.astype(jnp.float32)  # noqa: E731  (exact: every BF16 value is an FP32 value)
    mu = optax.tree.update_moment(updates, jax.tree.map(widen, state.mu), b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, jax.tree.map(widen, state.nu), b2, 2)
    count = numerics.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu_hat, nu_hat)  # + 0.0: optax's eps_root
    narrow = lambda t: t.astype(dtype)  # noqa: E731
    return updates, optax.ScaleByAdamState(count=count, mu=jax.tree.map(narrow, mu), nu=jax.tree.map(narrow, nu))

  return optax.GradientTransformation(init_fn, update_fn)


def adamw_stored(learning_rate, *, b1: float, b2: float, eps: float, weight_decay: float, mask=None,
                 state_dtype: str) -> optax.GradientTransformation:
  """``optax.adamw``'s chain (Adam scaling, decoupled weight decay, -learning rate) with ``scale_by_adam_stored``."""
  return optax.chain(scale_by_adam_stored(b1, b2, eps, state_dtype), optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))


def has_memory_kind(kind: str, device=None) -> bool:
  """Whether ``device`` (this process's first) can hold arrays in memory ``kind`` (e.g. "pinned_host")."""
  dev = device or jax.local_devices()[0]
  try:
    return kind in {m.kind for m in dev.addressable_memories()}
  except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
    return False


def check_offload(offload: str, device=None) -> None:
  """Raises, naming ``optim.offload``, when the backend cannot hold the optimizer state where it asks."""
  if offload == "none":
    return
  if not has_memory_kind(offload, device):
    dev = device or jax.local_devices()[0]
    kinds = sorted(m.kind for m in dev.addressable_memories())
    raise ValueError(f"optim.offload={offload!r}: device {dev} ({dev.platform}) has no {offload!r} memory (it has "
                     f"{kinds}); use optim.offload='none' (and optim.state_dtype='bfloat16' to save memory instead)")


def to_device(tree):
  """``tree`` in device memory, inside a jitted step (a no-op in the compiled program where it already is there:
  the default placement compiles to the same HLO)."""
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)
