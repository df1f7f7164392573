"""Is the sampler's arithmetic the trainer's? The two checks behind the one-engine promise (issue 15), as functions
that scripts (``scripts/check_one_engine.py``, ``scripts/check_layer_divergence.py``) and tests share.

``sampler_vs_trainer``: the jitted sampler generates completions, the trainer's forward recomputes their log-probs
(FP8Weight master params, the same K/V quantization): token_mult_prob_error, max |dlp| and the fraction of tokens
whose log-probs are bitwise equal.

``block_divergence``: block by block, layer by layer. Random tokens (rows x length) run through the trainer's forward
(FP8Weight masters, the whole sequence at once) and the sampler's path (QWeight params from
``sampler.prepare_params``; a prefill of the first length / 2 tokens into a KV cache, then one token per step through
``llama.forward`` with the cache, as the sampler's decode step calls it). While each step is traced, the blocks
``llama.decoder_layer`` calls are wrapped so that their outputs become outputs of the step: every layer's norms,
attention output, MLP output and the residual stream entering each norm, the final norm, and the head's log-prob. For
each tensor: the fraction of decode rows bitwise equal to the training rows and the max |difference|; the first tensor
that differs is where the engines part. Wrapping makes the blocks' outputs materialize, which can change XLA's fusions a
little against the real steps (``sampler_vs_trainer`` measures those).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax
from fp8jax import kvcache as kvc
from fp8jax import ops, recipes, sampler, sharding
from fp8jax.model import ModelConfig, gqa, head, init_params, llama, mla
from fp8jax.rl import grpo, learner


def model_config(dim: int, layers: int, vocab: int) -> ModelConfig:
  """The checks' random model: Llama-shaped, head_dim 128 (64 below dim 512), 4 query heads per KV head, or 2 where
  one 64-wide KV head would make the K/V projections narrower than the Hopper FP8 GEMM's 128-wide blocks (dim 256:
  without this the default shape stopped on a GPU with "N = 64 ... must be a multiple of 128")."""
  hd = 128 if dim >= 512 else 64
  n_heads = dim // hd
  n_kv = max(1, n_heads // 4)
  if n_kv * hd % 128 and n_heads % (128 // hd) == 0:
    n_kv = 128 // hd
  return ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                     ffn_dim=int(dim * 3.5) // 128 * 128, max_seq_len=4096)


def add_model_args(ap):
  """The checks' shared command-line flags (scripts/check_one_engine.py, scripts/check_layer_divergence.py): the
  random model's shape, the head's recipe, the JSON output; ``model_config(a.dim, a.layers, a.vocab)`` builds it."""
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--quantize_lm_head", action="store_true",
                  help="FP8 recipes put the output head on the (batch-invariant) FP8 GEMM too")
  ap.add_argument("--out", default="")
  return ap


def promised_recipes(quantize_lm_head: bool = False) -> dict[str, recipes.Recipe]:
  """The three recipes the one-engine promise covers: BF16, FP8, FP8 + FP8 KV cache."""
  return {"bf16": recipes.Recipe(mode="bf16"), "fp8": recipes.Recipe(quantize_lm_head=quantize_lm_head),
          "fp8+kv": recipes.Recipe(kv_cache="fp8", quantize_lm_head=quantize_lm_head)}


def sampler_vs_trainer(cfg: ModelConfig, recipe: recipes.Recipe, prompts, *, slots: int, samples: int, max_new: int,
                       seed: int = 0, bucket: int = 64, mesh=None, master=None, temperature: float = 1.0,
                       stop_token_ids: tuple[int, ...] = ()) -> dict:
  """Generate ``samples`` completions per prompt, recompute their log-probs as the trainer does, compare.
  ``bucket``: the prompt length bucket (prompts up to that many tokens). ``mesh``: the sampler's (its weights
  placed by the sharding rules; data-parallel rollouts where it has no tensor axis); the trainer runs on one device.
  ``master``: the policy's master params (e.g. a checkpoint's, ``hf.load_params``); default a random init.
  ``stop_token_ids``: a real model's EOS ids (a completion ends there; the trainer masks what follows)."""
  master = init_params(cfg, seed=seed, std=0.05) if master is None else master
  lcfg = ops.LinearConfig.from_recipe(recipe)
  sc = sampler.SamplerConfig(slots=slots, max_len=bucket + max_new, prompt_buckets=(bucket,), kv_cache=recipe.kv_cache)
  s = sampler.Sampler(cfg, sc, dataclasses.replace(lcfg, mesh=mesh))
  sp_params = sampler.prepare_params(master, recipe)
  if mesh is not None:
    sp_params = jax.device_put(sp_params, sharding.tree_shardings(sp_params, mesh))
  kv = s.calibrate_kv_scales(sp_params, prompts, 1.25) if recipe.kv_cache == "fp8" else None
  sp = sampler.SamplingParams(max_new_tokens=max_new, seed=1, temperature=temperature,
                              stop_token_ids=tuple(stop_token_ids))
  ro = s.generate(sp_params, prompts, sp, n=samples, kv_scales=kv)
  seq, mask, gen_lp = ro.sequences()
  policy = learner.Policy(cfg, lcfg, recipe)  # the trainer's log-probs, as its loss and mismatch pass read them
  trainer_lp = fp8jax.jit(lambda p, t: policy.logprobs(p, t, kv_scales=kv)[0])(master, jnp.asarray(seq))
  m = {k: float(v) for k, v in grpo.mismatch_metrics(jnp.asarray(gen_lp), trainer_lp, jnp.asarray(mask)).items()}
  sel = mask > 0
  m["bitwise_equal_frac"] = float(np.mean(np.asarray(trainer_lp)[sel] == gen_lp[sel]))
  m["tokens"] = int(sel.sum())
  m["rollout_devices"] = ro.stats["rollout_devices"]
  return m


_CAPTURED: list[tuple[str, jax.Array]] = []


def _spy(name, fn, pick):
  def wrapped(*args, **kw):
    out = fn(*args, **kw)
    _CAPTURED.append((name, pick(out)))
    return out
  return wrapped


@contextlib.contextmanager
def _spies():
  """Wrap the blocks ``llama.decoder_layer`` calls (module attributes, looked up at trace time); restored after."""
  first = lambda out: out[0]  # noqa: E731
  targets = [(llama, "add_rms_norm", "norm", lambda out: out[1]), (gqa, "attention", "attention", first),
             (mla, "attention", "attention", first), (llama, "mlp", "mlp", None),
             (llama, "moe", "moe", first), (llama, "moe", "moe experts", lambda out: out[1].expert_ids_BxTxK),
             (llama, "add_rms_norm", "residual", first)]
  saved = [(mod, n, getattr(mod, n)) for mod, n, _, _ in targets]
  try:
    for mod, n, label, pick in targets:  # a block listed twice is wrapped twice (both outputs captured)
      setattr(mod, n, _spy(label, getattr(mod, n), pick or (lambda out: out)))
    yield
  finally:
    for mod, n, fn in saved:
      setattr(mod, n, fn)


def _captured(fn, labels: list[str]):
  """fn(...) -> (result, [tensor]) for the blocks traced inside ``fn``; ``labels`` gets their names (numbered in
  call order) when the step is traced."""
  def run(*args):
    _CAPTURED.clear()
    res = fn(*args)
    seen: dict[str, int] = {}
    labels.clear()
    for name, _ in _CAPTURED:
      seen[name] = seen.get(name, -1) + 1
      labels.append(f"{name}[{seen[name]}]")
    return res, [x for _, x in _CAPTURED]
  return run


def block_divergence(cfg: ModelConfig, recipe: recipes.Recipe, rows: int, length: int, seed: int = 0) -> list[dict]:
  """[{tensor, rows_bitwise, max_abs_diff, max_abs (of the training values)}] in call order (module docstring)."""
  with _spies():
    return _block_divergence(cfg, recipe, rows, length, seed)


def _block_divergence(cfg, recipe, rows, length, seed):
  master = init_params(cfg, seed=seed, std=0.05)
  tokens = jax.random.randint(jax.random.key(seed + 1), (rows, length), 0, cfg.vocab_size)
  lcfg = ops.LinearConfig.from_recipe(recipe)
  train_params = recipes.mark_fp8(master, recipe)
  kv_scales = None
  if recipe.kv_cache == "fp8":
    _, _, aux = fp8jax.jit(lambda p, t: llama.forward(p, t, cfg, lcfg))(train_params, tokens)
    kv_scales = (kvc.scales_from_amax(aux.k_amax_L, 1.25), kvc.scales_from_amax(aux.v_amax_L, 1.25))

  def train(p, t):
    lp, _, _ = llama.next_token_logprobs(p, t, cfg, lcfg, kv_scales=kv_scales)
    return lp
  train_labels, step_labels = [], []
  train_lp, train_cap = fp8jax.jit(_captured(train, train_labels))(train_params, tokens)
  train_cap = dict(zip(train_labels, train_cap), **{"head log-prob": train_lp})

  samp_params = sampler.prepare_params(master, recipe)
  heads, head_dim, values = cfg.kv_cache_layout
  cache = kvc.init_cache(cfg.n_layers, rows, kvc.padded_len(length), heads, head_dim, values=values,
                         fp8=recipe.kv_cache == "fp8", k_scale_L=None if kv_scales is None else kv_scales[0],
                         v_scale_L=None if kv_scales is None else kv_scales[1])
  prompt = length // 2

  def prefill(p, t, c):
    pos = jnp.broadcast_to(jnp.arange(t.shape[1], dtype=jnp.int32), t.shape)
    return llama.forward(p, t, cfg, lcfg, positions_BxT=pos, cache=c)[1]
  cache = fp8jax.jit(prefill)(samp_params, tokens[:, :prompt], cache)

  def decode(p, tok_B, pos_B, next_B, c):
    hidden, c, _ = llama.forward(p, tok_B[:, None], cfg, lcfg, positions_BxT=pos_B[:, None], cache=c)
    lg, lse = head.logits_and_lse(head.head_weight(p, cfg.tie_embeddings), hidden[:, 0], lcfg)
    return head.token_logprob(lg, lse, next_B), c
  step = fp8jax.jit(_captured(decode, step_labels))

  same: dict[str, list] = {}
  diff: dict[str, float] = {}
  size: dict[str, float] = {}
  for pos in range(prompt, length - 1):
    (lp, cache), cap = step(samp_params, tokens[:, pos], jnp.full((rows,), pos, jnp.int32), tokens[:, pos + 1], cache)
    for name, x in [*zip(step_labels, cap), ("head log-prob", lp)]:
      r = train_cap[name][:, pos]
      a, b = np.asarray(x, np.float32).reshape(rows, -1), np.asarray(r, np.float32).reshape(rows, -1)
      same.setdefault(name, []).append(np.all(a == b, axis=1))
      diff[name] = max(diff.get(name, 0.0), float(np.max(np.abs(a - b))))
      size[name] = max(size.get(name, 0.0), float(np.max(np.abs(b))))
  return [{"tensor": n, "rows_bitwise": float(np.mean(same[n])), "max_abs_diff": diff[n], "max_abs": size[n]}
          for n in same]
