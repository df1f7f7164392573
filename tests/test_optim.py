"""Adam with BF16-stored moments (``optim.state_dtype``, fp8jax/optim.py) against optax's FP32 Adam and a plain-jnp
reference, and the host offload of the optimizer state (``optim.offload``) against the on-device update."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax import optim
from fp8jax.rl.learner import OptimConfig, make_optimizer

B1, B2, EPS, STEPS = 0.9, 0.999, 1e-8, 6
U = 2.0**-8  # BF16's unit roundoff: 8 significant bits, round to nearest even


def _grads(n=STEPS, shape=(64, 48), seed=0):
  """Gradients of very different magnitudes per column (nu spans ~1e-16 .. 1), some exact zeros. One leaf: with two,
  XLA:CPU fuses the optimizer's update into one multi-output loop whose division rounds differently in the last
  ulp from the reference program's (seen here), so a bitwise comparison needs programs of the same shape."""
  rng = np.random.default_rng(seed)
  scale = np.logspace(-8, 0, shape[1])[None]
  gs = [(rng.standard_normal(shape) * scale).astype(np.float32) for _ in range(n)]
  for g in gs:
    g[0, :5] = 0.0
  return [{"w": jnp.asarray(g)} for g in gs]


@fp8jax.jit
def _reference_step(g, mu, nu, t):
  """Plain jnp: one step of FP32 Adam math from BF16-stored moments (jitted as the optimizer is: XLA:CPU rounds an
  eager op sequence and a fused program differently in the last ulp)."""
  f32 = jnp.float32
  m = f32(1 - B1) * g + f32(B1) * mu.astype(f32)
  v = f32(1 - B2) * (g * g) + f32(B2) * nu.astype(f32)
  # the bias corrections in FP32 too: 1 - fp32(b)^t (as optax computes them; not fp32(1 - b^t))
  bc1, bc2 = (f32(1) - f32(b) ** t for b in (B1, B2))
  d = (m / bc1) / (jnp.sqrt(v / bc2 + 0.0) + f32(EPS))  # + 0.0: optax's eps_root term, kept
  return d, m.astype(jnp.bfloat16), v.astype(jnp.bfloat16), m, v


def _reference(grads):
  """FP32 Adam math, both moments rounded to BF16 after each update (the step's direction from the unrounded FP32
  moments). Returns per step (direction, stored mu, stored nu, unrounded mu, unrounded nu)."""
  mu = nu = jnp.zeros(grads[0]["w"].shape, jnp.bfloat16)
  out = []
  for t, g in enumerate(grads, 1):
    d, mu, nu, m, v = _reference_step(g["w"], mu, nu, jnp.int32(t))
    out.append((d, mu, nu, m, v))
  return out


def _run(tx, grads):
  """Per step (direction, state) of ``tx`` fed ``grads`` (params unused by Adam's scaling), jitted."""
  params = jax.tree.map(jnp.zeros_like, grads[0])
  state = tx.init(params)
  upd = fp8jax.jit(tx.update)
  out = []
  for g in grads:
    d, state = upd(g, state, params)
    out.append((d, state))
  return out


def test_float32_state_is_optax_adam_bit_for_bit():
  """state_dtype float32: the transform is optax.scale_by_adam, bit for bit, moments and directions."""
  grads = _grads()
  ours, theirs = _run(optim.scale_by_adam_stored(B1, B2, EPS, "float32"), grads), \
      _run(optax.scale_by_adam(B1, B2, EPS), grads)
  for (d1, s1), (d2, s2) in zip(ours, theirs):
    for a, b in zip(jax.tree.leaves((d1, s1)), jax.tree.leaves((d2, s2))):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_moments_equal_the_plain_reference_exactly():
  """state_dtype bfloat16: BF16 moments in the state, equal to the plain-jnp reference's (FP32 math, rounded after
  each update) bit for bit, and so are the directions."""
  grads = _grads()
  ref = _reference(grads)
  for t, ((d, s), (rd, rmu, rnu, _, _)) in enumerate(zip(_run(optim.scale_by_adam_stored(B1, B2, EPS, "bfloat16"),
                                                                grads), ref), 1):
    assert s.mu["w"].dtype == s.nu["w"].dtype == jnp.bfloat16 and int(s.count) == t
    np.testing.assert_array_equal(np.asarray(s.mu["w"], np.float32), np.asarray(rmu, np.float32))
    np.testing.assert_array_equal(np.asarray(s.nu["w"], np.float32), np.asarray(rnu, np.float32))
    np.testing.assert_array_equal(np.asarray(d["w"]), np.asarray(rd))


def test_bf16_moments_stay_within_their_rounding_of_optax_fp32_adam():
  """Against optax's FP32 Adam: step 1's direction is the same bits (the update uses the unrounded moments); after
  that the moments differ by at most the propagated rounding, |e_t| <= b * |e_{t-1}| + 2^-8 |m_t| (module docstring
  of fp8jax/optim.py; m_t the unrounded value), and each direction by what that moment error allows:
  |d~ - d| <= |dm^| / D~ + |m^| |D~ - D| / (D D~), D = sqrt(v^) + eps, |D~ - D| <= |dv^| / (sqrt(v~^) + sqrt(v^))."""
  grads = _grads()
  ref = _reference(grads)
  fp32 = _run(optax.scale_by_adam(B1, B2, EPS), grads)
  em = ev = np.zeros(grads[0]["w"].shape)
  slack = 2.0**-20  # FP32 rounding of the two paths' own arithmetic, relative
  for t, ((rd, rmu, rnu, m_un, v_un), (d32, s32)) in enumerate(zip(ref, fp32), 1):
    m_un, v_un = np.asarray(m_un, np.float64), np.asarray(v_un, np.float64)
    mu32, nu32 = np.asarray(s32.mu["w"], np.float64), np.asarray(s32.nu["w"], np.float64)
    if t == 1:
      np.testing.assert_array_equal(np.asarray(rd), np.asarray(d32["w"]))
    # this step's unrounded moments differ from FP32 Adam's by the carried error only (plus FP32 rounding of the
    # sum's terms: (1 - b1) g and b1 mu may cancel)
    gw = np.abs(np.asarray(grads[t - 1]["w"], np.float64))
    dm = B1 * em + slack * ((1 - B1) * gw + B1 * np.abs(mu32)) + 1e-45
    dv = B2 * ev + slack * np.abs(v_un) + 1e-45
    assert np.all(np.abs(m_un - mu32) <= dm)
    assert np.all(np.abs(v_un - nu32) <= dv)
    bc1, bc2 = (1 - np.float64(np.float32(b)) ** t for b in (B1, B2))
    D, Dt = np.sqrt(nu32 / bc2) + EPS, np.sqrt(v_un / bc2) + EPS
    bound = (dm / bc1) / Dt + np.abs(mu32 / bc1) * (dv / bc2) / ((np.sqrt(v_un / bc2) + np.sqrt(nu32 / bc2)) * D * Dt
                                                                   + 1e-300)
    err = np.abs(np.asarray(rd, np.float64) - np.asarray(d32["w"], np.float64))
    assert np.all(err <= bound * (1 + 1e-3) + 4 * slack * np.abs(np.asarray(d32["w"], np.float64)) + 1e-30), \
        (t, float(np.max(err - bound)))
    # the stored moments: the unrounded ones rounded once more (2^-8 relative; BF16 subnormals: 2^-134)
    em = np.abs(np.asarray(rmu, np.float64) - mu32)
    ev = np.abs(np.asarray(rnu, np.float64) - nu32)
    assert np.all(em <= dm + U * np.abs(m_un) + 2.0**-134)
    assert np.all(ev <= dv + U * np.abs(v_un) + 2.0**-134)
  assert np.max(em) > 0  # the rounding is really there (a test of BF16 storage, not of FP32)


def test_make_optimizer_keeps_optax_adamw_for_float32_and_halves_the_moments_for_bf16():
  """The default builds optax.adamw itself (today's optimizer, bit for bit); bfloat16 stores both moments in 2 bytes
  each and follows the same chain (clip, Adam, decoupled decay, -lr): equal to float32's first step bit for bit."""
  p = {"w": jnp.ones((8, 128)), "b": jnp.ones((128,))}
  g = {"w": jnp.full((8, 128), 0.5), "b": jnp.full((128,), -0.25)}
  oc = OptimConfig(lr=1e-2, weight_decay=0.1)
  tx32, _ = make_optimizer(oc, 10)
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(oc.lr, b1=oc.b1, b2=oc.b2, eps=oc.eps,
                                                                weight_decay=oc.weight_decay))
  u1, _ = tx32.update(g, tx32.init(p), p)
  u2, _ = ref.update(g, ref.init(p), p)
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tx16, _ = make_optimizer(dataclasses.replace(oc, state_dtype="bfloat16"), 10)
  s16 = tx16.init(p)
  mom = [x for x in jax.tree.leaves(s16) if x.ndim]
  assert {x.dtype for x in mom} == {jnp.dtype(jnp.bfloat16)} and len(mom) == 4
  u3, _ = tx16.update(g, s16, p)
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u3)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_keys_are_checked_by_name():
  with pytest.raises(ValueError, match=r"optim\.state_dtype='float16'"):
    OptimConfig(state_dtype="float16")
  with pytest.raises(ValueError, match=r"optim\.offload='disk'"):
    OptimConfig(offload="disk")
  with pytest.raises(ValueError, match=r"optim\.offload='pinned_host'.*has no 'pinned_host' memory"):
    optim.check_offload("pinned_host", _NoHostDevice())
  optim.check_offload("none", _NoHostDevice())


@pytest.mark.parametrize("key,value,match", [
    ("lr", -1e-6, r"optim\.lr=-1e-06 must be a finite number >= 0 \(a negative rate ascends the loss\)"),
    ("lr", float("nan"), r"optim\.lr=nan must be a finite number"),
    ("schedule", "linear", r"optim\.schedule='linear' is not one of \('constant'"),
    ("warmup_steps", -1, r"optim\.warmup_steps=-1 must be >= 0"),
    ("min_lr_ratio", 1.5, r"optim\.min_lr_ratio=1\.5 must be in \[0, 1\]"),
    ("weight_decay", -0.1, r"optim\.weight_decay=-0\.1 must be >= 0"),
    ("b1", 1.0, r"optim\.b1=1\.0 must be in \[0, 1\)"),
    ("b2", -0.5, r"optim\.b2=-0\.5 must be in \[0, 1\)"),
    ("eps", 0.0, r"optim\.eps=0\.0 must be > 0"),
    ("grad_clip", -1.0, r"optim\.grad_clip=-1\.0 must be >= 0 \(0 turns clipping off\)"),
])
def test_bad_optimizer_values_are_refused_by_name(key, value, match):
  """A value that would train wrongly without failing (a negative learning rate ascends the loss; b1 = 1 freezes
  Adam's first moment) is refused when the config is read, naming the key; the defaults and the edges pass."""
  with pytest.raises(ValueError, match=match):
    OptimConfig(**{key: value})
  OptimConfig(lr=0.0, b1=0.0, b2=0.0, grad_clip=0.0, weight_decay=0.0, min_lr_ratio=0.0)
  OptimConfig(min_lr_ratio=1.0, schedule="cosine", warmup_steps=0)


class _NoHostDevice:
  """A device whose backend offers device memory only (as some plugins do)."""
  platform = "fake"

  def addressable_memories(self):
    return [type("Mem", (), {"kind": "device"})()]


def test_offloaded_state_lives_in_host_memory_and_trains_as_on_device(tmp_path):
  """optim.offload='pinned_host' on this machine's CPU: the master and the Adam moments (BF16 here) are held in
  host memory between steps and a whole RL step (refit, rollout, mismatch pass, train step) gives the same state, bit
  for bit, as the on-device run.

  What the CPU checks: that the offloaded run is expressible (XLA:CPU offers a "pinned_host" memory kind; the train
  step moves the master and moments to the device inside the program and its outputs return to host memory: the
  lowered step's signature puts its state arguments and results in host memory), that it changes no arithmetic,
  and that the state keeps its placement across steps. What it cannot: on a CPU "device" and "pinned_host" memory
  are the same RAM, so the transfers are copies at most and no device memory is saved; whether XLA:GPU schedules
  the host->device copy of the moments late (for the update) and the device bytes the step then needs are measured
  on a GPU (scripts/plan_memory.py --measure_steps, docs in fp8jax/rl/memory.py).
  """
  from fp8jax.rl.trainer import RLTrainer  # noqa: PLC0415
  from test_trainer import _parity_score, small_config  # noqa: PLC0415

  if not optim.has_memory_kind("pinned_host"):
    pytest.skip("this backend has no pinned_host memory")
  from fp8jax.rl import source  # noqa: PLC0415

  orig = source.ArithmeticSource.score
  source.ArithmeticSource.score = _parity_score  # rewards with variance: a real gradient
  try:
    runs = []
    for offload in ("none", "pinned_host"):
      t = RLTrainer(small_config(**{"optim.offload": offload, "optim.state_dtype": "bfloat16",
                                    "warmstart.steps": 0}), str(tmp_path / offload))
      m = t.step(0)
      runs.append((t, m))
  finally:
    source.ArithmeticSource.score = orig
  (t0, m0), (t1, m1) = runs
  assert m0["grad_norm"] == m1["grad_norm"] > 0 and m1["token_mult_prob_error"] == 1.0
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves((t1.state.params, t1.state.opt_state))}
  assert kinds == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves((t0.state.params, t0.state.opt_state))} == {"device"}
  for a, b in zip(jax.tree.leaves(t0.state), jax.tree.leaves(t1.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  lowered = t1.learner.train_step.lower(t1.state, _batch_like(t1)).as_text()
  assert 'mhlo.memory_kind = "pinned_host"' in lowered  # host memory in the program's own signature


def _batch_like(t):
  """A minibatch of the trainer's shapes (host arrays; values do not matter for the compiled program's layout)."""
  from fp8jax import sharding  # noqa: PLC0415
  from fp8jax.rl import memory  # noqa: PLC0415

  r = t.c.rollout
  _, batch = memory.train_step_args(t.learner, t.gc.batch // t.gc.minibatches,
                                    t.worker.sampler.scfg.bucket(max(r.prompt_buckets)) + r.max_new_tokens)
  host = {k: np.zeros(v.shape, v.dtype) for k, v in batch.items() if k != "kv_scales"}
  out = sharding.shard_batch(host, t.learner.mesh)
  if "kv_scales" in batch:
    out["kv_scales"] = tuple(t.learner.replicated(np.ones(x.shape, np.float32)) for x in batch["kv_scales"])
  return out
