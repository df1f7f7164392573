"""Where the FP8 recipe loses accuracy on a real model, and which ``fp8.keep_*`` setting buys most of it back.

Measured on real text: chat-formatted problems from a data file, each followed by the BF16 model's own greedy
continuation (the sampler, stopping at the model's EOS), so the positions cover prompt and generated text alike. At
every position the FP8 model's next-token distribution q is compared with the BF16 model's p (the same weights,
``fp8.mode="bf16"``): KL(p || q) in nats per token and top-1 agreement, averaged over the generated positions (the
distributions a rollout samples from; the headline) and over all positions. Variants: the FP8 recipe; each decoder
layer kept in BF16 alone (``keep_patterns=("layers/i/*",)``); each kind of linear kept in BF16 in every layer
(``("layers/*/wq",)``, ...). Then ``search`` looks for the cheapest setting (fewest bytes of BF16 linear weights)
that halves the recipe's KL on the generated positions: a single variant if one does, else units added greedily by
KL removed per byte, each cumulative set measured.

Every variant runs the model's own blocks (``llama.decoder_layer``, the chunked head) with the recipe's weights
(``recipes.quantize_params``), one layer per jitted call, so each distinct layer structure (all FP8, all BF16, one
kind in BF16) compiles once instead of the whole 30-layer forward once per variant. ``check_driver`` confirms that
this gives ``llama.forward``'s log-probs. The FP8 KV cache (``fp8.kv_cache``) is left out: the variants differ in
weights and activations only. ``scripts/fp8_sensitivity.py`` is the command line; docs/fp8_sensitivity.md has a run.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax.numpy as jnp
import numpy as np

import fp8jax
from fp8jax import hf, ops, recipes
from fp8jax import sampler as sampler_lib
from fp8jax.model import head, llama
from fp8jax.model.config import ModelConfig
from fp8jax.model.layers import add_rms_norm, rope_inv_freq

# The dense Llama block's linears, by the name the sensitivity table uses.
KINDS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


@dataclasses.dataclass(frozen=True)
class Texts:
  seqs: list  # prompt + continuation token ids
  prompt_lens: list  # tokens of the chat-formatted prompt
  stopped: float  # fraction of continuations that reached EOS


def build_texts(hf_dir: str, data_file: str, n: int, template: str, continuation: int, params=None,
                slots: int = 16) -> Texts:
  """The first ``n`` problems of ``data_file`` in the chat template + the BF16 model's greedy continuation."""
  from fp8jax.rl import data, evaluate  # noqa: PLC0415

  tok = hf.load_tokenizer(hf_dir)
  examples = data.load_prompts(data_file, template=template, max_examples=n)
  prompts = [evaluate.chat_prompt_ids(tok, e.prompt) for e in examples]
  bucket = -(-max(len(p) for p in prompts) // 128) * 128
  cfg = hf.load_config(hf_dir, max_seq_len=bucket + continuation)
  params = hf.load_params(hf_dir, cfg) if params is None else params
  recipe = recipes.Recipe(mode="bf16")
  scfg = sampler_lib.SamplerConfig(slots=slots, max_len=bucket + continuation, prompt_buckets=(bucket,))
  s = sampler_lib.Sampler(cfg, scfg, ops.LinearConfig.from_recipe(recipe))
  sp = sampler_lib.SamplingParams(greedy=True, max_new_tokens=continuation, stop_token_ids=tuple(tok.eos_ids))
  ro = s.generate(s.sampling_form(sampler_lib.prepare_params(params, recipe)), prompts, sp)
  seqs = [p + ro.tokens[i, :ro.lengths[i]].tolist() for i, p in enumerate(prompts)]
  return Texts(seqs, [len(p) for p in prompts], float(np.mean(ro.finish_reason == sampler_lib.FINISH_STOP)))


@functools.partial(fp8jax.jit, static_argnames=("cfg", "lcfg"))
def _layer(p, x, h, positions_BxT, *, cfg: ModelConfig, lcfg: ops.LinearConfig):
  # layer=0 for every layer: a dense Llama block's code depends on its index only through MoE placement and the KV
  # cache / KV scales (none here), so all layers of one structure share one compiled program.
  (x, h), _, _, _ = llama.decoder_layer(p, x, h, positions_BxT, cfg, lcfg, rope_inv_freq(cfg), layer=0, cache=None,
                                        kv_scales=None, own_positions=True, defer_add=True)
  return x, h


@functools.partial(fp8jax.jit, static_argnames=("cfg", "lcfg"))
def _embed(params, tokens_BxT, *, cfg: ModelConfig, lcfg: ops.LinearConfig):
  del lcfg
  return params["embed"].astype(jnp.dtype(cfg.dtype))[tokens_BxT]


@functools.partial(fp8jax.jit, static_argnames=("cfg", "lcfg"))
def _logprobs(params, x, h, *, cfg: ModelConfig, lcfg: ops.LinearConfig):
  _, hn = add_rms_norm(x, h, params["final_norm"], cfg.norm_eps, cfg.norm_backend, lcfg.mesh)
  b, t, d = hn.shape
  lg, lse = head.logits_and_lse(head.head_weight(params, cfg.tie_embeddings), hn.reshape(b * t, d), lcfg)
  return lg - lse[:, None]


@fp8jax.jit
def _compare(ref_NxV, logq_NxV):
  """Per position: KL(p || q) with p = exp(ref) (FP32 log-probs), and whether the argmaxes agree."""
  kl = jnp.sum(jnp.exp(ref_NxV) * (ref_NxV - logq_NxV), axis=-1)
  return kl, jnp.argmax(ref_NxV, -1) == jnp.argmax(logq_NxV, -1)


def forward_logprobs(params, tokens_BxT, cfg: ModelConfig, lcfg: ops.LinearConfig):
  """(B*T, V) FP32 next-token log-probs of ``llama.forward`` + the head, one jitted call per layer."""
  if cfg.n_experts or cfg.is_mla:
    raise ValueError("fp8jax.sensitivity drives dense Llama-family blocks only (model has MoE or MLA layers)")
  lcfg = dataclasses.replace(lcfg, out_dtype=cfg.dtype)
  t = tokens_BxT.shape[1]
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_BxT.shape)
  x, h = _embed(params, tokens_BxT, cfg=cfg, lcfg=lcfg), None
  for p in params["layers"]:
    x, h = _layer(p, x, h, positions, cfg=cfg, lcfg=lcfg)
  return _logprobs(params, x, h, cfg=cfg, lcfg=lcfg)


def bf16_linear_bytes(params, recipe: recipes.Recipe) -> int:
  """Bytes of the decoder layers' linear weights that ``recipe`` keeps in BF16 (2 per element)."""
  n_layers, total = len(params["layers"]), 0
  for i, layer in enumerate(params["layers"]):
    for name in recipes.LINEAR_NAMES:
      if name in layer and not recipe.selects(f"layers/{i}/{name}", i, n_layers):
        total += 2 * int(np.prod(layer[name].shape))
  return total


class Evaluator:
  """The BF16 reference distributions of ``texts`` (held in FP32), and ``run(recipe)`` -> KL and top-1 vs them."""

  def __init__(self, cfg: ModelConfig, params, texts: Texts, batch: int = 4, pad_id: int = 0):
    self.cfg, self.params, self.texts = cfg, params, texts
    t = max(len(s) for s in texts.seqs)
    self.batches = []
    for b0 in range(0, len(texts.seqs), batch):
      rows = texts.seqs[b0:b0 + batch]
      rows = rows + [rows[-1]] * (batch - len(rows))  # a full last batch (one shape); the copies are masked out
      toks = np.full((batch, t), pad_id, np.int32)
      gen, every = np.zeros((batch, t), bool), np.zeros((batch, t), bool)
      for r, s in enumerate(rows):
        toks[r, :len(s)] = s
        if b0 + r < len(texts.seqs):  # position j predicts token j + 1: the last token predicts nothing here
          every[r, :len(s) - 1] = True
          gen[r, texts.prompt_lens[b0 + r] - 1:len(s) - 1] = True
      self.batches.append((jnp.asarray(toks), gen.reshape(-1), every.reshape(-1)))
    bf16 = recipes.Recipe(mode="bf16", gemm_backend="xla")
    self.ref = [forward_logprobs(recipes.quantize_params(params, bf16), toks, cfg, ops.LinearConfig.from_recipe(bf16))
                for toks, _, _ in self.batches]

  @property
  def tokens(self) -> dict:
    return {"generated": int(sum(g.sum() for _, g, _ in self.batches)),
            "all": int(sum(e.sum() for _, _, e in self.batches))}

  def run(self, recipe: recipes.Recipe) -> dict:
    t0 = time.perf_counter()
    qp = recipes.quantize_params(self.params, recipe)
    lcfg = ops.LinearConfig.from_recipe(recipe)
    kl_g, kl_a, t1_g, t1_a = [], [], [], []
    for (toks, gen, every), ref in zip(self.batches, self.ref):
      kl, top1 = (np.asarray(x) for x in _compare(ref, forward_logprobs(qp, toks, self.cfg, lcfg)))
      kl_g.append(kl[gen])
      kl_a.append(kl[every])
      t1_g.append(top1[gen])
      t1_a.append(top1[every])
    cat = np.concatenate
    return {"kl_gen": float(cat(kl_g).mean()), "top1_gen": float(cat(t1_g).mean()),
            "kl_all": float(cat(kl_a).mean()), "top1_all": float(cat(t1_a).mean()),
            "kl_gen_max": float(cat(kl_g).max()), "bf16_bytes": bf16_linear_bytes(self.params, recipe),
            "seconds": round(time.perf_counter() - t0, 1)}


def check_driver(ev: Evaluator, recipe: recipes.Recipe) -> float:
  """max |log-prob difference| between the per-layer driver and ``llama.forward`` + ``llama.logits`` (jitted whole)
  on the first batch: 0.0 when the driver is the model's forward."""
  toks = ev.batches[0][0]
  qp = recipes.quantize_params(ev.params, recipe)
  lcfg = ops.LinearConfig.from_recipe(recipe)

  def whole(p, x):
    hid, _, _ = llama.forward(p, x, ev.cfg, lcfg)
    lg, lse = head.logits_and_lse(head.head_weight(p, ev.cfg.tie_embeddings), hid.reshape(-1, hid.shape[-1]), lcfg)
    return lg - lse[:, None]

  ours = np.asarray(forward_logprobs(qp, toks, ev.cfg, lcfg))
  return float(np.max(np.abs(ours - np.asarray(fp8jax.jit(whole)(qp, toks)))))


def keep_setting(layers: list[int], kinds: list[str], n_layers: int) -> dict:
  """The ``fp8.keep_*`` config keys that keep ``layers`` (whole) and ``kinds`` (in every layer) in BF16."""
  layers = sorted(set(layers))
  first = 0
  while first in layers:
    first += 1
  last = 0
  while n_layers - 1 - last in layers and n_layers - 1 - last >= first:
    last += 1
  middle = [i for i in layers if first <= i < n_layers - last]
  patterns = tuple(f"layers/{i}/*" for i in middle) + tuple(f"layers/*/{KINDS[k]}" for k in kinds)
  return {"keep_first_n": first, "keep_last_n": last, "keep_patterns": patterns}


def recipe_for(base: recipes.Recipe, setting: dict) -> recipes.Recipe:
  return dataclasses.replace(base, **setting)


def sweep(ev: Evaluator, base: recipes.Recipe, log=print) -> dict:
  """The recipe, then each layer and each kind of linear kept in BF16 alone (module docstring)."""
  n_layers = ev.cfg.n_layers
  out = {"fp8": ev.run(base), "layers": [], "kinds": []}
  log(f"fp8 recipe: {out['fp8']}")
  for k in KINDS:
    r = ev.run(recipe_for(base, keep_setting([], [k], n_layers)))
    out["kinds"].append({"kind": k, **r})
    log(f"  {k:5s} in BF16: {r}")
  for i in range(n_layers):
    r = ev.run(recipe_for(base, keep_setting([i], [], n_layers)))
    out["layers"].append({"layer": i, **r})
    log(f"  layer {i:2d} in BF16: {r}")
  return out


def search(ev: Evaluator, base: recipes.Recipe, swept: dict, max_steps: int = 12, log=print) -> dict:
  """The cheapest setting found that halves the recipe's KL on generated positions (module docstring)."""
  n_layers, target = ev.cfg.n_layers, swept["fp8"]["kl_gen"] / 2
  units = [(("layer", r["layer"]), r) for r in swept["layers"]] + [(("kind", r["kind"]), r) for r in swept["kinds"]]
  single = [(r["bf16_bytes"], u, r) for u, r in units if r["kl_gen"] <= target]
  if single:
    nbytes, u, r = min(single, key=lambda x: x[0])
    setting = keep_setting([u[1]] if u[0] == "layer" else [], [u[1]] if u[0] == "kind" else [], n_layers)
    return {"target_kl_gen": target, "found": True, "how": "single", "setting": setting, **r, "steps": []}
  gain = sorted(((swept["fp8"]["kl_gen"] - r["kl_gen"]) / r["bf16_bytes"], u) for u, r in units
                if r["kl_gen"] < swept["fp8"]["kl_gen"])
  layers, kinds, steps, r, setting = [], [], [], None, None
  for _, u in reversed(gain[-max_steps:]):
    (layers if u[0] == "layer" else kinds).append(u[1])
    setting = keep_setting(layers, kinds, n_layers)
    r = ev.run(recipe_for(base, setting))
    steps.append({"added": f"{u[0]} {u[1]}", "setting": setting, **r})
    log(f"  + {u[0]} {u[1]}: {r}")
    if r["kl_gen"] <= target:
      return {"target_kl_gen": target, "found": True, "how": "greedy", "setting": setting, **r, "steps": steps}
  return {"target_kl_gen": target, "found": False, "how": "greedy", "setting": setting, **(r or {}), "steps": steps}
