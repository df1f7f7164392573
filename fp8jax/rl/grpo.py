"""GRPO building blocks: group advantages, the clipped policy-gradient loss, importance weights, mismatch metrics.

Every function here is pure ``jnp`` with static shapes: ragged things (responses of different lengths, groups that
are dropped) are expressed with masks, never with boolean indexing, so all of it jits once and shards like any other
array code. Python-level options (``agg``, ``kind``, ``dual_clip``, whether a reference policy exists) are static.

Shapes (names carry them): ``B`` sequences (prompts x generations, flattened), ``T`` response tokens,
``B x G`` rewards of ``B`` prompt groups with ``G`` generations each. Log-probabilities are those of the sampled
token at each response position (``log pi(y_t | y_<t, x)``); ``mask_BxT`` is 1 on response tokens that count.

Conventions shared by all functions:

* Positions where ``mask_BxT == 0`` may hold anything (garbage log-probs of padding, even inf/NaN): they are replaced
  by neutral values *before* any ``exp`` ("double where"), so they contribute neither to the value nor -- as a NaN
  through ``0 * inf`` -- to the gradient.
* Metrics are masked means over the tokens of *this* call (a microbatch); ``num_tokens`` is returned so the caller
  can re-weight when it averages metrics over microbatches (``fp8jax.rl.learner.Loss.combine`` does).

The recipe follows NeMo RL's GRPO (leave-one-out baseline, optional leave-one-out std normalization, token-level
loss, k3 KL to a reference) with DAPO's clip-higher, dynamic sampling and overlong filtering, dual-clip PPO, and the
importance-sampling corrections used against sampler/trainer mismatch (TIS, ICEPOP, sequence-mask TIS).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np



# ------------------------------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------------------------------


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def _check_same_shape(**arrays) -> None:
  shapes = {k: tuple(np.shape(v)) for k, v in arrays.items() if v is not None}
  if len(set(shapes.values())) > 1:
    raise ValueError(f"shape mismatch: {shapes}")


def _masked_sum(x, mask):
  return jnp.sum(jnp.where(mask > 0, x, 0.0))


def _masked_mean(x, mask):
  """Mean of ``x`` over ``mask > 0`` (0 when the mask is empty, never NaN)."""
  return _masked_sum(x, mask) / jnp.maximum(jnp.sum(mask > 0), 1)


def _masked_max(x, mask, empty=0.0):
  m = jnp.max(jnp.where(mask > 0, x, -jnp.inf))
  return jnp.where(jnp.any(mask > 0), m, empty)


def _masked_min(x, mask, empty=0.0):
  m = jnp.min(jnp.where(mask > 0, x, jnp.inf))
  return jnp.where(jnp.any(mask > 0), m, empty)


def _safe_log_diff(a_BxT, b_BxT, mask_BxT):
  """``a - b`` on the mask and exactly 0 elsewhere (the inner "where" of the double-where trick)."""
  valid = mask_BxT > 0
  a = jnp.where(valid, _f32(a_BxT), 0.0)
  b = jnp.where(valid, _f32(b_BxT), 0.0)
  return a - b


def k3_kl(logp, ref_logp):
  """Schulman's k3 estimator of KL(pi || ref) per sampled token: ``exp(r - l) - (r - l) - 1``, ``r = ref, l = logp``.

  For tokens sampled from ``pi`` it is unbiased for KL(pi || ref) and, unlike ``l - r`` (k1), never negative
  (``e^x - x - 1 >= 0``), which keeps the per-token penalty well behaved (http://joschu.net/blog/kl-approx.html).
  """
  return _k3(_f32(ref_logp) - _f32(logp))


def _k3(d):
  """``e^d - d - 1`` of a log-ratio ``d`` (k3_kl's formula, shared by mismatch_metrics' gen_kl_error), computed as
  ``expm1(d) - d``: in FP32, ``exp(d) - d - 1`` loses everything to cancellation where it matters most (|d| < 1e-3,
  nearly equal policies: at d = 1e-4 the true 5e-9 drowns in exp's 6e-8 rounding) and can come out negative
  (d = 6e-8 gave -6e-8); ``expm1(d) >= d`` holds after rounding, so this is >= 0, with relative error ~ulp(d) / d^2."""
  return jnp.expm1(d) - d


# ------------------------------------------------------------------------------------------------------------------
# Advantages
# ------------------------------------------------------------------------------------------------------------------


def group_advantages(rewards_BxG, *, normalize_std: bool, leave_one_out: bool = True, eps: float = 1e-6):
  """GRPO advantages per prompt group. Returns ``(adv_BxG, valid_group_B)``.

  Baseline (row ``b`` is one prompt's ``G`` generations):

  * ``leave_one_out=True`` (RLOO, Ahmadian et al. 2024, as NeMo RL's default): ``baseline_i = mean_{j != i} r_j``.
    Unlike the plain group mean, the baseline of sample ``i`` does not contain ``r_i``, so it is independent of the
    action it scores and the policy gradient stays unbiased. Note ``r_i - mean_{j!=i} r_j = G/(G-1) (r_i - mean r)``.
  * ``leave_one_out=False``: ``baseline_i = mean_j r_j`` (the original GRPO group mean).

  Std normalization (``normalize_std=True``) follows NeMo RL's ``calculate_baseline_and_std_per_prompt`` exactly
  (nemo_rl/algorithms/utils.py, read for this module):

  * leave-one-out: ``std_i`` is the *unbiased sample std of the other G-1 rewards* (divisor G-2) -- a per-sample
    value, not one number per group. With ``G == 2`` there is a single "other" reward and NeMo's formula gives
    0/0 -> 0, so G=2 is never normalized.
  * group mean: ``std`` is the unbiased sample std of all G rewards (divisor G-1).
  * ``adv_i = (r_i - baseline_i) / (std_i + eps)`` only where ``std_i > 0``; where ``std_i == 0`` the advantage is
    left unnormalized ("don't sharpen the ones with no variation"). A consequence worth knowing: with leave-one-out
    and G >= 3, a lone outlier (e.g. rewards [1, 0, 0, 0]) keeps its raw advantage (1.0) while the others are
    normalized (-1/3 / 0.577 = -0.577); we keep NeMo's behaviour so recipes transfer.

  ``valid_group_B`` is True where the group's rewards are not all equal (max > min, an exact comparison, so float
  noise in a mean cannot fake a variation). Where it is False every advantage is set to exactly 0: such a group
  carries no learning signal in GRPO, and DAPO's dynamic sampling drops it (see ``dynamic_sampling_keep``).
  ``G == 1`` gives all-invalid groups and zero advantages.

  Rewards are computed in FP32; the std uses a centered two-pass formula (not E[x^2]-E[x]^2) so equal rewards give
  an exact 0.
  """
  r = _f32(rewards_BxG)
  valid_group_B = dynamic_sampling_keep(r)  # checks the shape
  g = r.shape[1]
  if g < 2:
    return jnp.zeros_like(r), valid_group_B

  if leave_one_out:
    n_other = g - 1
    baseline = (jnp.sum(r, axis=1, keepdims=True) - r) / n_other  # (B, G): mean of the others
    if normalize_std:
      # sum_{j != i} (r_j - m_i)^2 = sum_j (r_j - m_i)^2 - (r_i - m_i)^2, with m_i the others' mean.
      dev_BxGxG = r[:, None, :] - baseline[:, :, None]  # [b, i, j] = r_j - m_i
      ss = jnp.sum(dev_BxGxG**2, axis=2) - (r - baseline) ** 2
      ss = jnp.maximum(ss, 0.0)
      std = jnp.sqrt(ss / (n_other - 1)) if n_other >= 2 else jnp.zeros_like(r)
  else:
    baseline = jnp.broadcast_to(jnp.mean(r, axis=1, keepdims=True), r.shape)
    if normalize_std:
      std = jnp.sqrt(jnp.sum((r - baseline) ** 2, axis=1, keepdims=True) / (g - 1))
      std = jnp.broadcast_to(std, r.shape)

  adv = r - baseline
  if normalize_std:
    adv = jnp.where(std > 0, adv / (std + eps), adv)
  adv = jnp.where(valid_group_B[:, None], adv, 0.0)
  return adv, valid_group_B


def dynamic_sampling_keep(rewards_BxG):
  """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): keep prompt groups whose rewards are not all equal.

  All-correct or all-wrong groups have zero advantage under any group baseline, so they only dilute the batch;
  DAPO drops them and samples more prompts until the batch is full. Returns a bool mask ``(B,)``; the refill is the
  caller's job (it is a host-side loop over the sampler).
  """
  r = _f32(rewards_BxG)
  if r.ndim != 2:
    raise ValueError(f"rewards_BxG must be 2-D (prompts, generations), got shape {r.shape}")
  return jnp.max(r, axis=1) > jnp.min(r, axis=1)


def overlong_mask(finish_reason_or_truncated_B, *, truncated_reasons: Sequence[str] = ("length",)):
  """DAPO overlong filtering (Yu et al. 2025, sec. 3.4): a float ``(B,)`` mask, 0.0 for truncated responses.

  A response cut off by the length limit has no final answer, so its (usually zero) reward says nothing about its
  reasoning; masking its loss removes that noise. Multiply it into ``mask_BxT`` (``mask * keep[:, None]``).

  Accepts either a boolean array (True = truncated; jit-friendly) or a sequence of finish-reason strings such as
  vLLM's/ours ``"stop"`` / ``"length"`` (host side; a reason in ``truncated_reasons`` counts as truncated).
  """
  x = finish_reason_or_truncated_B
  if isinstance(x, (list, tuple)) and any(isinstance(v, str) for v in x):
    bad = [v for v in x if not isinstance(v, str)]
    if bad:
      raise TypeError(f"overlong_mask: mixed finish reasons and non-strings, e.g. {bad[0]!r}")
    truncated = np.array([v in truncated_reasons for v in x], dtype=bool)
    return jnp.asarray(~truncated, jnp.float32)
  arr = jnp.asarray(x)
  if arr.dtype != jnp.bool_:
    raise TypeError(
        f"overlong_mask expects a bool 'truncated' array or finish-reason strings, got dtype {arr.dtype}")
  return (~arr).astype(jnp.float32)


# ------------------------------------------------------------------------------------------------------------------
# Importance weights and mismatch metrics
# ------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _RatioView:
  """What an importance-weight kind sees of ``r = exp(train - gen)`` per token (``importance_weights`` builds it)."""
  raw: jax.Array  # r (B, T); exactly 1 off the mask
  raw_fin: jax.Array  # r where finite, else 0
  finite: jax.Array  # isfinite(r)
  in_bounds: jax.Array  # lo <= r <= hi (all True without bounds)
  log_ratio: jax.Array  # train - gen on the mask, 0 elsewhere
  valid: jax.Array  # the mask (bool)


def _w_none(v: _RatioView, lo, hi):
  return jnp.ones_like(v.raw), None


def _w_token(v: _RatioView, lo, hi):
  return v.raw_fin, None


def _w_tis(v: _RatioView, lo, hi):
  return jnp.where(v.finite, jnp.clip(v.raw, lo, hi), 0.0), None


def _w_icepop(v: _RatioView, lo, hi):
  return jnp.where(v.finite & v.in_bounds, v.raw, 0.0), None


def _w_seq_mask_tis(v: _RatioView, lo, hi):
  n_tok_B = jnp.sum(v.valid, axis=1)
  lr_fin = jnp.where(jnp.isfinite(v.log_ratio), v.log_ratio, 0.0)
  seq_has_nonfinite_B = jnp.any(v.valid & ~jnp.isfinite(v.log_ratio), axis=1)
  geo_B = jnp.exp(jnp.sum(jnp.where(v.valid, lr_fin, 0.0), axis=1) / jnp.maximum(n_tok_B, 1))
  # A sequence with a NaN/inf log-ratio has no meaningful geometric mean: drop it as out of bounds.
  keep_B = (geo_B >= lo) & (geo_B <= hi) & ~seq_has_nonfinite_B
  return jnp.where(keep_B[:, None], v.raw_fin, 0.0), ~keep_B & (n_tok_B > 0)


# grpo.is_kind -> (ratio view, lo, hi) -> (weights (B, T) before masking, sequences dropped (B,) or None). A new
# correction is one function here; importance_weights documents each kind.
IS_WEIGHTS = {"none": _w_none, "token": _w_token, "tis": _w_tis, "icepop": _w_icepop, "seq_mask_tis": _w_seq_mask_tis}
IS_KINDS = tuple(IS_WEIGHTS)


def importance_weights(train_logp_BxT, gen_logp_BxT, mask_BxT, *, kind: str = "none", lo: float | None = None,
                       hi: float | None = None):
  """Off-policy correction weights ``w = pi_train(y) / pi_gen(y)`` per token. Returns ``(w_BxT, metrics)``.

  The tokens were sampled by the generator ``pi_gen`` but the loss is an expectation under ``pi_train``; when the
  two engines disagree (two-engine FP8 systems, stale rollouts) the per-token ratio corrects for it. In fp8jax the
  sampler and trainer share every kernel, so on GPU ``w == 1`` and ``kind='none'`` is the default; the other kinds
  exist for off-policy use and for comparison with two-engine setups. Kinds:

  * ``'none'``: all ones.
  * ``'token'``: the raw ratio ``exp(train - gen)``.
  * ``'tis'``: truncated IS, the ratio clamped to ``[lo, hi]`` (Yao et al. 2025; ``lo=0`` gives the one-sided
    ``min(w, hi)`` form).
  * ``'icepop'``: the ratio where ``lo <= w <= hi`` and 0 outside -- tokens whose probabilities the engines disagree
    on too much are dropped instead of being down-weighted (IcePop, Ling team 2025).
  * ``'seq_mask_tis'``: a sequence is dropped (all its weights 0) when its geometric-mean ratio
    ``exp(mean_t(train - gen))`` over its masked tokens is outside ``[lo, hi]``; kept sequences use the raw token
    ratios. The geometric mean is length-invariant, unlike the product of ratios.

  The weights are wrapped in ``stop_gradient``: they re-weight the loss, they are not optimized. A non-finite
  weight (NaN log-prob, overflow) on a masked-in token becomes 0 and is counted in ``nonfinite_zeroed``.
  Positions outside ``mask_BxT`` get weight 1 in every kind (neutral; the loss mask removes them).

  Metrics (masked means over this call): ``is_ratio_mean`` (raw ratio, over finite ones), ``is_ratio_max``,
  ``is_oob_frac`` (fraction of tokens whose raw ratio is outside ``[lo, hi]``; 0 when no bounds),
  ``is_seq_dropped_frac`` (seq_mask_tis only, else 0), ``is_weight_mean``, ``nonfinite_zeroed`` (a count).
  """
  if kind not in IS_KINDS:
    raise ValueError(f"importance_weights: kind={kind!r} is not one of {IS_KINDS}")
  _check_same_shape(train_logp_BxT=train_logp_BxT, gen_logp_BxT=gen_logp_BxT, mask_BxT=mask_BxT)
  needs_bounds = kind in ("tis", "icepop", "seq_mask_tis")
  if needs_bounds and (lo is None or hi is None):
    raise ValueError(f"importance_weights: kind={kind!r} needs both lo and hi (got lo={lo}, hi={hi})")
  if needs_bounds and not (0.0 <= lo <= hi):
    raise ValueError(f"importance_weights: need 0 <= lo <= hi, got lo={lo}, hi={hi}")

  valid = _f32(mask_BxT) > 0
  log_ratio = _safe_log_diff(train_logp_BxT, gen_logp_BxT, valid)
  raw = jnp.exp(log_ratio)
  finite = jnp.isfinite(raw)
  raw_fin = jnp.where(finite, raw, 0.0)
  has_bounds = lo is not None and hi is not None
  in_bounds = (raw >= lo) & (raw <= hi) if has_bounds else jnp.ones_like(valid)

  w, seq_dropped_B = IS_WEIGHTS[kind](_RatioView(raw, raw_fin, finite, in_bounds, log_ratio, valid), lo, hi)
  if seq_dropped_B is None:
    seq_dropped_B = jnp.zeros(raw.shape[0], bool)

  nonfinite_zeroed = jnp.sum(valid & ~finite) if kind != "none" else jnp.zeros((), jnp.int32)
  w = jnp.where(valid, w, 1.0)
  w = jax.lax.stop_gradient(w)

  n_seq_B = jnp.sum(jnp.any(valid, axis=1))
  metrics = {
      "is_ratio_mean": _masked_mean(raw_fin, valid & finite),
      "is_ratio_max": _masked_max(raw_fin, valid & finite),
      "is_oob_frac": _masked_mean((~in_bounds).astype(jnp.float32), valid) if has_bounds else jnp.zeros(()),
      "is_seq_dropped_frac": jnp.sum(seq_dropped_B) / jnp.maximum(n_seq_B, 1),
      "is_weight_mean": _masked_mean(w, valid),
      "nonfinite_zeroed": nonfinite_zeroed,
  }
  return w, jax.tree.map(jax.lax.stop_gradient, metrics)


def mismatch_metrics(gen_logp_BxT, train_logp_BxT, mask_BxT) -> dict[str, jax.Array]:
  """How far the sampler's log-probs are from the trainer's on the same tokens (masked means over this call).

  * ``token_mult_prob_error``: mean of ``exp(|gen - train|)``; exactly 1.0 when the engines agree bit for bit
    (NeMo RL's metric; the fp8jax one-engine design must read 1.0 on GPU).
  * ``gen_kl_error``: mean k3 with ``r = train, l = gen``, i.e. ``exp(train - gen) - (train - gen) - 1``, an
    unbiased, non-negative per-token estimate of KL(pi_gen || pi_train) for tokens sampled from pi_gen.
  * ``max_abs_logp_diff``: max ``|gen - train|``.
  * ``sampling_importance_ratio``: mean of ``exp(train - gen)``.

  Non-finite differences on masked-in tokens are excluded from the means and counted in ``nonfinite_tokens``.
  """
  _check_same_shape(gen_logp_BxT=gen_logp_BxT, train_logp_BxT=train_logp_BxT, mask_BxT=mask_BxT)
  valid = _f32(mask_BxT) > 0
  d = _safe_log_diff(train_logp_BxT, gen_logp_BxT, valid)  # train - gen
  fin = jnp.isfinite(d)
  ok = valid & fin
  d = jnp.where(ok, d, 0.0)
  return jax.lax.stop_gradient({
      # 1 + mean(expm1): exactly 1.0 when every difference is 0 (expm1(0) = 0, a sum of zeros is 0). As a mean of
      # exp(|d|) it read 1 +- 2^-23 on the GPU at steps where every difference was 0 (max_abs_logp_diff 0).
      "token_mult_prob_error": 1.0 + _masked_mean(jnp.expm1(jnp.abs(d)), ok),
      "gen_kl_error": _masked_mean(_k3(d), ok),
      "max_abs_logp_diff": _masked_max(jnp.abs(d), ok),
      "sampling_importance_ratio": 1.0 + _masked_mean(jnp.expm1(d), ok),
      "nonfinite_tokens": jnp.sum(valid & ~fin),
  })


# ------------------------------------------------------------------------------------------------------------------
# Policy loss
# ------------------------------------------------------------------------------------------------------------------


def _token_mean(x_BxT, n_tok_B, *, n_tok, n_seq):
  """NeMo RL / DAPO's token-level loss: ``sum_{b,t} x / N_tok``."""
  del n_tok_B, n_seq
  return jnp.sum(x_BxT) * (1.0 / jnp.maximum(_f32(n_tok), 1.0))


def _seq_mean(x_BxT, n_tok_B, *, n_tok, n_seq):
  """The original GRPO's: per sequence the mean over its tokens, then ``sum_b / N_seq``."""
  del n_tok
  return jnp.sum(jnp.sum(x_BxT, axis=1) / jnp.maximum(n_tok_B, 1)) / jnp.maximum(_f32(n_seq), 1.0)


# grpo.agg -> (masked per-token values (B, T), tokens per sequence (B,), *, n_tok, n_seq) -> the loss; policy_loss
# documents each. n_tok / n_seq are the whole batch's counts under gradient accumulation (the microbatches' sum).
AGGREGATIONS = {"token_mean": _token_mean, "seq_mean": _seq_mean}
AGG_KINDS = tuple(AGGREGATIONS)


def policy_loss(logp_BxT, old_logp_BxT, adv_B, mask_BxT, *, eps_low: float, eps_high: float,
                dual_clip: float | None = None, agg: str = "token_mean", is_weights_BxT=None, ref_logp_BxT=None,
                kl_beta: float = 0.0, global_token_count=None, global_seq_count=None,
                entropy_BxT=None) -> tuple[jax.Array, dict[str, Any]]:
  """Clipped policy-gradient loss (PPO/GRPO) with clip-higher, dual clip, IS weights and a k3 KL penalty.

  Per token, with ``ratio = exp(logp - old_logp)`` and advantage ``A`` (the sequence's ``adv_B``, or a per-token
  ``(B, T)`` array):

    ``pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``

  Separate ``eps_low`` / ``eps_high`` are DAPO's clip-higher (Yu et al. 2025, sec. 3.1): a larger upper bound lets
  low-probability tokens with positive advantage grow, which fights entropy collapse. With ``dual_clip = c > 1``
  (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5) the loss of tokens with ``A < 0`` is also
  capped at ``-c * A``: without it a huge ratio on a negative-advantage token gives an unbounded loss.
  Where a clip is active the token's gradient is exactly 0.

  Then ``loss_t = w_t * (pg_t + kl_beta * k3_t)`` with ``w = is_weights_BxT`` (detached; 1 if None) and
  ``k3_t = exp(ref - logp) - (ref - logp) - 1``. The KL term is weighted by ``w`` too, because it is also an
  expectation under the trainer's policy estimated from the generator's tokens (as NeMo RL does).
  ``kl_beta == 0`` (a Python number) skips the KL entirely and ``ref_logp_BxT`` may be None -- the caller then skips
  the reference forward. ``kl_beta != 0`` without ``ref_logp_BxT`` is an error.

  Aggregation:

  * ``'token_mean'`` (NeMo RL / DAPO token-level loss): ``sum_{b,t} mask * loss / N_tok``. Long responses weigh in
    proportion to their length. ``global_token_count`` is ``N_tok`` of the *whole* batch: with gradient
    accumulation, pass the full batch's masked-token count to every microbatch and *sum* the microbatch losses;
    the result equals the full-batch token mean exactly. Default: this call's token count.
  * ``'seq_mean'`` (original GRPO): per sequence the mean over its tokens, then ``sum_b / N_seq`` where ``N_seq``
    counts sequences with at least one token; ``global_seq_count`` plays the role of ``global_token_count``.

  Returns ``(loss, metrics)``; metrics are detached masked means over this call:
  ``pg_loss``, ``kl`` (mean k3; only when computed), ``kl_loss`` (its share of the loss), ``ratio_mean/min/max``,
  ``clip_frac_low`` (A < 0 and ratio < 1 - eps_low), ``clip_frac_high`` (A > 0 and ratio > 1 + eps_high),
  ``dual_clip_frac`` (A < 0 and ratio > c), ``neg_logp`` (mean -logp of the sampled tokens: an on-policy estimate
  of the entropy), ``entropy`` (mean of ``entropy_BxT`` when given), ``adv_mean``, ``num_tokens``, ``num_seqs``.
  """
  if agg not in AGG_KINDS:
    raise ValueError(f"policy_loss: agg={agg!r} is not one of {AGG_KINDS}")
  if dual_clip is not None and not dual_clip > 1.0:
    raise ValueError(f"policy_loss: dual_clip must be > 1 (or None), got {dual_clip}")
  _check_same_shape(logp_BxT=logp_BxT, old_logp_BxT=old_logp_BxT, mask_BxT=mask_BxT,
                    is_weights_BxT=is_weights_BxT, ref_logp_BxT=ref_logp_BxT, entropy_BxT=entropy_BxT)
  if np.ndim(logp_BxT) != 2:
    raise ValueError(f"policy_loss: logp_BxT must be 2-D (B, T), got shape {np.shape(logp_BxT)}")
  b, _ = np.shape(logp_BxT)
  if np.shape(adv_B) not in ((b,), tuple(np.shape(logp_BxT))):
    raise ValueError(f"policy_loss: adv_B must have shape ({b},) or {tuple(np.shape(logp_BxT))}, "
                     f"got {np.shape(adv_B)}")
  skip_kl = isinstance(kl_beta, (int, float)) and kl_beta == 0
  if not skip_kl and ref_logp_BxT is None:
    raise ValueError(f"policy_loss: kl_beta={kl_beta} needs ref_logp_BxT (pass kl_beta=0.0 to skip the KL)")

  valid = _f32(mask_BxT) > 0
  adv = _f32(adv_B)
  adv_BxT = adv[:, None] if adv.ndim == 1 else adv
  adv_BxT = jnp.broadcast_to(adv_BxT, valid.shape)
  adv_BxT = jnp.where(valid, adv_BxT, 0.0)

  # 1. Ratio, with masked-out positions forced to log-ratio 0 before the exp (no NaN gradients from padding).
  log_ratio = _safe_log_diff(logp_BxT, jax.lax.stop_gradient(_f32(old_logp_BxT)), valid)
  ratio = jnp.exp(log_ratio)

  # 2. Clipped surrogate, clip-higher, dual clip.
  clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  pg = jnp.maximum(-adv_BxT * ratio, -adv_BxT * clipped_ratio)
  if dual_clip is not None:
    pg = jnp.where(adv_BxT < 0, jnp.minimum(pg, -dual_clip * adv_BxT), pg)

  # 3. KL to the reference (k3), only when asked for.
  if not skip_kl:
    ref = jnp.where(valid, jax.lax.stop_gradient(_f32(ref_logp_BxT)), 0.0)
    lp = jnp.where(valid, _f32(logp_BxT), 0.0)
    kl = k3_kl(lp, ref)
    per_tok = pg + kl_beta * kl
  else:
    kl = None
    per_tok = pg

  # 4. Importance weights (detached) and masking.
  if is_weights_BxT is not None:
    w = jnp.where(valid, jax.lax.stop_gradient(_f32(is_weights_BxT)), 0.0)
  else:
    w = valid.astype(jnp.float32)
  per_tok = jnp.where(valid, w * per_tok, 0.0)

  # 5. Aggregation (AGGREGATIONS[agg]).
  n_tok_B = jnp.sum(valid, axis=1)
  n_tok = jnp.sum(n_tok_B)
  n_seq = jnp.sum(n_tok_B > 0)
  reduce = AGGREGATIONS[agg]
  counts = dict(n_tok=n_tok if global_token_count is None else global_token_count,
                n_seq=n_seq if global_seq_count is None else global_seq_count)
  loss = reduce(per_tok, n_tok_B, **counts)
  pg_part = reduce(jnp.where(valid, w * pg, 0.0), n_tok_B, **counts)

  # 6. Metrics (detached).
  sg = jax.lax.stop_gradient
  r = sg(ratio)
  vf = valid.astype(jnp.float32)
  metrics = {
      "loss": sg(loss),
      "pg_loss": sg(pg_part),
      "kl_loss": sg(loss - pg_part),
      "ratio_mean": _masked_mean(r, valid),
      "ratio_min": _masked_min(r, valid, 1.0),
      "ratio_max": _masked_max(r, valid, 1.0),
      "clip_frac_low": _masked_mean(((adv_BxT < 0) & (r < 1.0 - eps_low)) * vf, valid),
      "clip_frac_high": _masked_mean(((adv_BxT > 0) & (r > 1.0 + eps_high)) * vf, valid),
      "dual_clip_frac": (_masked_mean(((adv_BxT < 0) & (r > dual_clip)) * vf, valid)
                         if dual_clip is not None else jnp.zeros(())),
      "neg_logp": _masked_mean(-sg(_f32(logp_BxT)), valid),
      "adv_mean": _masked_mean(adv_BxT, valid),
      "num_tokens": n_tok,
      "num_seqs": n_seq,
  }
  if kl is not None:
    metrics["kl"] = _masked_mean(sg(kl), valid)
  if entropy_BxT is not None:
    metrics["entropy"] = _masked_mean(sg(_f32(entropy_BxT)), valid)
  return loss, metrics
