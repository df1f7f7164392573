"""LoRA on a frozen block-FP8 / BF16 base (fp8jax.lora): the op, one engine with adapters, the gradients, the GRPO
loop (adapters only, KL reference = the base, checkpoints), the PEFT and merged exports, the configs."""

import fp8jax  # noqa: F401  (first: XLA flags)

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import llama8b_bf16_lora, llama8b_fp8_lora, qwen3_8b_bf16_lora, qwen3_8b_fp8_lora, tiny_fp8
from fp8jax import hf, lora, ops, quant, recipes, sampler
from fp8jax.model import ModelConfig, llama
from fp8jax.rl import learner, memory, source
from fp8jax.rl import trainer as trainer_lib
from test_trainer import _parity_score
from test_trainer import small_config as trainer_small_config

RECIPES = {"bf16": recipes.Recipe(mode="bf16", gemm_backend="xla"),
           "fp8": recipes.Recipe(mode="fp8", gemm_backend="xla"),
           "fp8+kv": recipes.Recipe(mode="fp8", kv_cache="fp8", gemm_backend="xla")}
LORA = lora.LoRAConfig(rank=8, alpha=16.0)


def _tiny():
  return ModelConfig.from_config(tiny_fp8.get_config().model)


def _nonzero(adapters, seed=1, std=0.05):
  """Adapters with b drawn too (the init's b = 0 makes the low-rank path vanish)."""
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [x + std * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _logprobs(cfg, recipe, weights, toks, kv_scales=None):
  policy = learner.Policy(cfg, ops.LinearConfig.from_recipe(recipe), recipe, lora=LORA)
  return np.asarray(jax.jit(lambda p, t: policy.logprobs(p, t, kv_scales=kv_scales)[0])(weights, toks))


# ------------------------------------------------------------------------------------------------------------------
# The op and one engine
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_zero_b_is_the_base_model_bitwise(mode):
  """At the init (b = 0) the low-rank term is exactly 0 and the model is the base, bit for bit."""
  cfg, recipe = _tiny(), RECIPES[mode]
  base = sampler.prepare_params(llama.init_params(cfg, seed=0, std=0.05), recipe)
  adapters = lora.init_adapters(cfg, LORA)
  a0 = np.asarray(adapters["layers"][0]["wq"]["a"])
  assert np.all(np.asarray(adapters["layers"][1]["w_down"]["b"]) == 0) and np.abs(a0).max() <= 1 / np.sqrt(256)
  assert a0.std() > 0.5 / np.sqrt(3 * 256)  # U(-1/sqrt(K), 1/sqrt(K)) has std 1/sqrt(3K)
  toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
  np.testing.assert_array_equal(_logprobs(cfg, recipe, lora.attach(base, adapters, LORA), toks),
                                _logprobs(cfg, recipe, base, toks))


def test_op_matches_its_plain_jnp_reference_and_rejects_bad_adapters():
  """BF16 base: the op is ``lora_linear_reference`` (same roundings, plain jnp.dot) up to the FP32 sum order; the
  adapter shapes are checked, naming them."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(5, 256)), jnp.bfloat16)
  w, a, b = (jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32) for s in ((128, 256), (8, 256), (128, 8)))
  got = ops.linear(x, lora.LoRAWeight(w, a, b, 2.0), ops.LinearConfig(backend="xla"))
  ref = lora.lora_linear_reference(x, w, a, b, 2.0)
  assert got.dtype == jnp.bfloat16 and got.shape == (5, 128)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2**-7, atol=1e-6)
  with pytest.raises(ValueError, match=r"adapters a \(8, 128\) and b \(128, 8\) do not fit base \(128, 256\)"):
    ops.linear(x, lora.LoRAWeight(w, a[:, :128], b, 2.0))


@pytest.mark.parametrize("mode", ["bf16", "fp8+kv"])
def test_sampler_equals_trainer_with_nonzero_adapters(mode):
  """One engine with adapters: the sampler (BF16 adapters on the shared base, FP8 KV cache in "fp8+kv") and the
  trainer's forward (FP32 master adapters) give bitwise equal log-probs for the sampled tokens."""
  cfg, recipe = _tiny(), RECIPES[mode]
  base = sampler.prepare_params(llama.init_params(cfg, seed=0, std=0.05), recipe)
  weights = lora.attach(base, _nonzero(lora.init_adapters(cfg, LORA)), LORA)
  sweights = lora.sampling_weights(weights)
  assert sweights["layers"][0]["wq"].a.dtype == jnp.bfloat16 and sweights["layers"][0]["wq"].base is \
      weights["layers"][0]["wq"].base  # the base is shared, not copied
  prompts = [np.random.default_rng(i).integers(0, cfg.vocab_size, size=4 + 3 * i).tolist() for i in range(3)]
  sc = sampler.SamplerConfig(slots=4, max_len=16, prompt_buckets=(10,), kv_cache=recipe.kv_cache)
  s = sampler.Sampler(cfg, sc, ops.LinearConfig.from_recipe(recipe))
  kv = s.calibrate_kv_scales(sweights, prompts, 1.25) if recipe.kv_cache == "fp8" else None
  ro = s.generate(sweights, prompts, sampler.SamplingParams(max_new_tokens=6, seed=1), n=2, kv_scales=kv)
  seq, mask, gen_lp = ro.sequences()
  trainer_lp = _logprobs(cfg, recipe, weights, jnp.asarray(seq), kv)
  sel = mask > 0
  assert sel.sum() == 3 * 2 * 6
  np.testing.assert_array_equal(trainer_lp[sel], gen_lp[sel])
  # not vacuous: the adapters change the log-probs
  assert np.abs(_logprobs(cfg, recipe, base, jnp.asarray(seq), kv)[sel] - gen_lp[sel]).max() > 1e-2


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_gradients_reach_the_adapters_and_match_the_low_rank_math(mode):
  """d loss / d(a, b) of ``sum(g * y)`` against the low-rank update's gradients written out in float64 from the
  op's BF16 operands: db = s gy^T h, da = (s gy b)^T x, with h = bf16(x a^T). Tolerance 2**-6 of the largest entry:
  the op rounds h, the cotangent and da, db to BF16 (2**-9 relative each), and its sums are FP32. The base (FP8:
  a QWeight) gets a zero cotangent: no weight gradient is formed for it."""
  rng = np.random.default_rng(0)
  s, f64 = 2.0, np.float64
  x = jnp.asarray(rng.normal(size=(6, 256)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(128, 256)) * 0.05, jnp.float32)
  base = quant.quantize_weight(w) if mode == "fp8" else w.astype(jnp.bfloat16)
  a, b = (jnp.asarray(rng.normal(size=sh) * 0.1, jnp.float32) for sh in ((8, 256), (128, 8)))
  g = jnp.asarray(rng.normal(size=(6, 128)), jnp.float32)
  cfg = ops.LinearConfig(backend="xla")

  def loss(base, a, b):
    return jnp.sum(ops.linear(x, lora.LoRAWeight(base, a, b, s), cfg).astype(jnp.float32) * g)

  d_base, da, db = jax.grad(loss, argnums=(0, 1, 2))(base, a, b)
  if mode == "fp8":
    assert all(not np.any(np.asarray(t, np.float32)) for t in jax.tree.leaves(d_base))
  bf = lambda t: np.asarray(jnp.asarray(t).astype(jnp.bfloat16), f64)  # noqa: E731
  xb, ab, bb, gy = bf(x), bf(a), bf(b), bf(g)
  h = bf(xb @ ab.T)
  db_ref, da_ref = s * gy.T @ h, (s * gy @ bb).T @ xb
  for got, ref in ((db, db_ref), (da, da_ref)):
    assert got.dtype == jnp.float32  # the masters' dtype
    np.testing.assert_allclose(np.asarray(got, f64), ref, rtol=0, atol=2**-6 * np.abs(ref).max())


# ------------------------------------------------------------------------------------------------------------------
# The GRPO loop
# ------------------------------------------------------------------------------------------------------------------


# test_trainer's small run with LoRA on: no warm start (a LoRA run trains adapters on the base it starts from), a
# step size that moves rank-8 adapters within three steps, and the KL term on (its reference is the base).
LORA_RUN = {"warmstart.steps": 0, "lora.rank": 8, "lora.alpha": 16.0, "optim.lr": 1e-2, "grpo.kl_beta": 0.01}


def small_config(**overrides):
  return trainer_small_config(**{**LORA_RUN, **overrides})


def _p_even(tr, weights, prompts):
  """The policy's probability that the first completion token is even (the parity reward's expectation)."""
  lcfg = dataclasses.replace(tr.learner.policy.lcfg, out_dtype=tr.cfg.dtype)

  @jax.jit
  def p_even(w, toks):  # the arithmetic task's prompts all have one length
    hidden = llama.forward(w, toks, tr.cfg, lcfg)[0]
    return jnp.sum(jax.nn.softmax(llama.logits(w, hidden[:, -1:], tr.cfg, lcfg)[:, -1], axis=-1)[:, 0::2], -1)
  return np.asarray(p_even(weights, jnp.asarray(prompts)))


def test_lora_grpo_trains_adapters_only_and_resumes_bitwise(tmp_path, monkeypatch):
  """Three GRPO steps with LoRA (FP8 base, FP8 KV cache, KL on) on the tiny model: only the adapters and their
  optimizer state are trained and saved, the base never changes, one engine holds, the KL reference is the base, the
  policy moves toward the reward, and a resumed run continues bit for bit; a checkpoint of other LoRA settings or
  another base is refused, naming them. (The memory plan's compiles are skipped here: test_memory_plan_counts_lora.)"""
  monkeypatch.setattr(source.ArithmeticSource, "score", _parity_score)
  monkeypatch.setattr(trainer_lib, "_memory_plan", lambda *a, **k: None)
  tr = trainer_lib.RLTrainer(small_config(), str(tmp_path / "a"))
  st = tr.state
  assert set(st.params["layers"][0]) == set(lora.TARGETS) and st.ref_params is None
  adam_mu = st.opt_state[1][0].mu  # clip, then adamw's scale_by_adam: moments of the adapters alone
  assert jax.tree.structure(adam_mu) == jax.tree.structure(st.params)
  assert isinstance(st.base["layers"][0]["wq"], quant.QWeight)
  base_sum = lora.checksum(st.base)
  prompts, _ = tr.task.train_prompts(4, step=0)
  p0 = _p_even(tr, tr.learner.weights(st), prompts)
  np.testing.assert_array_equal(p0, _p_even(tr, st.base, prompts))

  m0 = tr.step(0)
  assert float(m0["token_mult_prob_error"]) <= 1 + 1e-5  # one engine (bitwise: test_sampler_equals_trainer_...)
  assert float(m0["kl"]) == 0.0 and float(m0["grad_norm"]) > 0  # policy == base at step 0
  m1 = tr.step(1)
  assert float(m1["kl"]) > 0
  assert lora.checksum(tr.state.base) == base_sum
  assert np.abs(np.asarray(tr.state.params["layers"][0]["wq"]["b"])).max() > 0
  assert np.mean(_p_even(tr, tr.learner.weights(tr.state), prompts)) > np.mean(p0)  # toward the reward
  tr.save(2)

  meta = tr.ckpt.read_meta(2)
  assert meta["lora"]["rank"] == 8 and meta["lora"]["base"]["checksum"] == base_sum
  saved = os.listdir(os.path.join(tr.ckpt.step_dir(2), "state"))
  assert not any("base" in f for f in saved), saved
  resumed = trainer_lib.RLTrainer(small_config(), str(tmp_path / "a"))
  assert resumed.restore() == 2
  for x, y in zip(jax.tree.leaves((tr.state.params, tr.state.opt_state, tr.state.step, tr.state.kv_scales)),
                  jax.tree.leaves((resumed.state.params, resumed.state.opt_state, resumed.state.step,
                                   resumed.state.kv_scales))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  a, b = tr.step(2), resumed.step(2)
  for k in ("reward_mean", "loss", "grad_norm", "kl", "token_mult_prob_error"):
    assert a[k] == b[k], (k, a[k], b[k])

  where = tr.ckpt.step_dir(2)
  with pytest.raises(trainer_lib.CheckpointMismatch, match=r"lora\.rank=4 in the checkpoint, 8 now"):
    tr._check_lora(where, {"lora": {**meta["lora"], "rank": 4}})
  with pytest.raises(trainer_lib.CheckpointMismatch, match=r"adapters of another base \(checksum 0000"):
    tr._check_lora(where, {"lora": {**meta["lora"], "base": {**meta["lora"]["base"], "checksum": "0000"}}})
  with pytest.raises(trainer_lib.CheckpointMismatch, match=r"holds full-parameter training, and this run has "
                                                            r"lora\.rank=8"):
    tr._check_lora(where, {})


def test_memory_plan_counts_lora(monkeypatch):
  """The plan's state rows of a LoRA run: the FP8 base (codes + scales + BF16 rest, no master), the FP32 adapters
  and their Adam moments, no KL reference copy; the sampler's weights are its BF16 adapters (the base is shared);
  the gradients the adapters'. XLA's compiled temporaries are stubbed out (zeros): shapes only."""
  zeros = {k: 0 for k in ("temp", "argument", "output", "alias", "host_temp", "host_argument", "host_output",
                          "host_alias")}
  monkeypatch.setattr(memory, "compile_train_step", lambda *a, **k: dict(zeros))
  monkeypatch.setattr(memory, "compile_rollout", lambda *a, **k: {"prefill": dict(zeros), "decode": dict(zeros)})
  p = trainer_lib.memory_plan(small_config())
  cfg = _tiny()
  n_lora = sum(np.prod(x.shape) for x in jax.tree.leaves(lora.adapter_shapes(cfg, LORA)))
  base = jax.eval_shape(lambda: sampler.prepare_params(llama.init_params(cfg), recipes.Recipe()))
  assert "master params (FP32)" not in p.state and not any("KL" in k for k in p.state), p.state
  assert p.state["LoRA adapters (FP32)"] == 4 * n_lora
  assert p.state["LoRA base (frozen: FP8 codes / BF16)"] == memory.tree_bytes(base)
  assert 8 * n_lora <= p.state["optimizer state"] <= 8 * n_lora + 64  # mu, nu (+ counts)
  assert p.rollout["sampler weights"] == 2 * n_lora and p.train["gradients (FP32 accumulator)"] == 4 * n_lora


# ------------------------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------------------------


def test_peft_and_merged_exports_load_in_transformers(tmp_path):
  """A tiny transformers Llama imported into fp8jax, nonzero adapters on its BF16 base: the PEFT export loaded by
  ``peft.PeftModel.from_pretrained`` (FP32), and the merged BF16 export loaded by transformers, give fp8jax's BF16
  LoRA logits to BF16 noise. Yardstick (as tests/test_hf.py): the same PEFT model run in BF16 vs FP32; bound 2x
  it, and 2**-4 of max |logit|; the adapters move the logits by far more than that (not vacuous)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  src = hf.make_tiny_hf_dir(str(tmp_path / "base"), "llama", seed=0)
  cfg = hf.load_config(src)
  recipe = RECIPES["bf16"]
  base = sampler.prepare_params(hf.load_params(src, cfg), recipe)
  adapters = _nonzero(lora.init_adapters(cfg, LORA), std=0.2)
  toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
  lcfg = dataclasses.replace(ops.LinearConfig.from_recipe(recipe), out_dtype=cfg.dtype)
  weights = lora.attach(base, adapters, LORA)
  ours = np.asarray(jax.jit(lambda p, t: llama.logits(p, llama.forward(p, t, cfg, lcfg)[0], cfg, lcfg))(weights,
                                                                                                       toks))
  out = str(tmp_path / "adapter")
  conf = lora.export_peft(adapters, LORA, out, src)
  assert conf["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
  with open(os.path.join(out, lora.PEFT_CONFIG)) as f:
    assert json.load(f)["peft_type"] == "LORA"

  def peft_logits(dtype):
    m = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    m = peft.PeftModel.from_pretrained(m, out).eval()
    with torch.no_grad():
      return m(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()

  ref, noise = peft_logits(torch.float32), peft_logits(torch.bfloat16)
  yard = np.abs(noise - ref).max()
  base_logits = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(
      torch.as_tensor(toks, dtype=torch.long)).logits.detach().float().numpy()
  tol = max(2 * yard, 1e-3)
  assert np.abs(ours - ref).max() <= min(tol, 2**-4 * np.abs(ref).max()), (np.abs(ours - ref).max(), yard)
  assert np.abs(base_logits - ref).max() > 10 * tol  # the adapters matter

  merged = str(tmp_path / "merged")
  lora.export_merged(base, adapters, LORA, cfg, merged, fmt="bf16", tokenizer_dir=src)
  m = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
  with torch.no_grad():
    got = m(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()
  assert np.abs(got - ref).max() <= tol, (np.abs(got - ref).max(), yard)
  # the block-FP8 merged export: the merged weights requantized, in the DeepSeek-V3 / vLLM convention
  qc = lora.export_merged(base, adapters, LORA, cfg, str(tmp_path / "merged_fp8"), fmt="fp8")
  assert qc["weight_block_size"] == [128, 128]


# ------------------------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------------------------


def test_configs_load_and_lora_is_off_by_default():
  assert lora.LoRAConfig.from_config(tiny_fp8.get_config()).enabled is False
  for mod, mode in ((llama8b_fp8_lora, "fp8"), (llama8b_bf16_lora, "bf16"), (qwen3_8b_fp8_lora, "fp8"),
                    (qwen3_8b_bf16_lora, "bf16")):
    c = mod.get_config()
    lc = lora.LoRAConfig.from_config(c)
    lc.check_model(ModelConfig.from_config(c.model))  # every target is a linear of the model's layers
    assert (lc.rank, lc.alpha, lc.targets, c.mesh.fsdp, c.fp8.mode) == (64, 128.0, lora.TARGETS, 1, mode)
    assert (c.rollout.max_len, c.rollout.max_new_tokens, max(c.rollout.prompt_buckets)) == (4096, 3584, 512)
    assert 1e-5 <= c.optim.lr <= 5e-5
    trainer_lib.validate_config(c)


@pytest.mark.parametrize("key,value,match", [
    ("lora.dropout", 0.1, r"lora\.dropout=0\.1: only 0\.0 is supported"),
    ("lora.rank", -1, r"lora\.rank=-1 must be an integer >= 0"),
    ("lora.alpha", 0.0, r"lora\.alpha=0\.0 must be a finite number > 0"),
    ("lora.targets", ("wq", "w_qkv"), r"lora\.targets=\('wq', 'w_qkv'\) must be distinct names from"),
    ("warmstart.steps", 2, r"warmstart\.steps=2 must be 0 with lora\.rank=8"),
    ("fp8.mode", "fp8_rollout", r"fp8\.mode='fp8_rollout' is not supported with lora\.rank=8"),
])
def test_bad_lora_keys_are_refused_before_work_starts(tmp_path, monkeypatch, key, value, match):
  monkeypatch.setattr(trainer_lib.RLTrainer, "_init_state", lambda self: pytest.fail("work started"))
  with pytest.raises(ValueError, match=match):
    trainer_lib.RLTrainer(small_config(**{key: value}), str(tmp_path))


def test_unknown_lora_keys_and_absent_targets_are_named(tmp_path, monkeypatch):
  monkeypatch.setattr(trainer_lib.RLTrainer, "_init_state", lambda self: pytest.fail("work started"))
  with pytest.raises(ValueError, match=r"lora\.targets must be a tuple of linear names from .*, got the string 'wq'"):
    lora.LoRAConfig(rank=8, targets="wq")
  c = small_config()
  c.lora.seed = 3
  with pytest.raises(ValueError, match=r"unknown lora config keys: \['seed'\]"):
    trainer_lib.RLTrainer(c, str(tmp_path))
  from configs import tiny_moe_fp8  # noqa: PLC0415  (both layers MoE: no dense MLP linears)
  moe = tiny_moe_fp8.get_config()
  moe.lora.rank, moe.warmstart.steps = 8, 0
  with pytest.raises(ValueError, match=r"lora\.targets: \['w_gate', 'w_up', 'w_down'\] are in no decoder layer"):
    trainer_lib.RLTrainer(moe, str(tmp_path))


def _entry_uses_of_fp8_params(hlo: str) -> list[str]:
  """Instructions of an optimized HLO module's ENTRY computation, other than the tuple that starts a loop, that
  read one of its FP8 parameters."""
  entry = hlo[hlo.index("\nENTRY "):]
  entry = entry[:entry.index("\n}")]
  lines = entry.splitlines()[1:]
  fp8 = {ln.split("=")[0].strip() for ln in lines if "f8e4m3fn[" in ln.split("=", 1)[-1].split("(")[0]
         and " parameter(" in ln}
  return [ln.strip()[:160] for ln in lines if " parameter(" not in ln and " tuple(" not in ln
          and any(f"{p}," in ln or f"{p})" in ln for p in fp8)]


def test_the_frozen_base_is_not_copied_out_of_the_microbatch_loop():
  """XLA moves loop-invariant work out of loops, and the frozen base is invariant over the train step's microbatch
  loop: XLA:CPU made every layer's FP32 copies of the base weights (for the forward and, transposed, the dgrad) once
  before the loop and held all of them through the step, two FP32 copies of the whole base on top of its FP8 codes.
  The base enters each microbatch behind the barrier that holds the microbatch, so whatever is made from it is made
  per layer inside the loop and freed. Checked on the compiled program (CPU, four microbatches): nothing outside the
  loop reads the base's FP8 codes."""
  tr_cfg = small_config(**{"grpo.microbatch": 1})
  lr = trainer_lib.learner_from_config(tr_cfg, jax.devices()[:1])
  args = memory.train_step_args(lr, 4, 32)
  hlo = lr.train_step.lower(*args).compile().as_text()
  assert "f8e4m3fn[" in hlo and " while(" in hlo
  assert _entry_uses_of_fp8_params(hlo) == []
