"""fp8jax vs PyTorch/transformers on one HF checkpoint: logits, KL, top-1, per-layer hidden states, block-FP8 GEMM.

  python scripts/compare_torch.py --make_tiny /tmp/tiny_llama             # a random tiny Llama-3 HF dir
  python scripts/compare_torch.py --hf_dir /tmp/tiny_llama [--prompts "Hi" "What is 2+2?"] [--batch 2 --seq 64]

Rows (reference: transformers' PyTorch model in float32):
  torch-bf16     transformers in bfloat16            (what "BF16 noise" looks like: the yardstick for the next row)
  fp8jax-bf16    fp8jax, BF16 recipe (bf16 compute, fp32 accumulation)
  fp8jax-fp8     fp8jax, FP8 recipe (128x128 weight tiles, 1x128 activation groups)
each with max/mean |logit diff|, KL(torch-f32 || row) per token (mean, max), top-1 agreement, and the relative error
of the residual stream after the embedding and after every decoder layer (where a divergence starts).
Then fp8jax's block-FP8 linear against the same block math written in PyTorch (torch.float8_e4m3fn, per-block
scales): the quantized bytes and scales must be identical, the outputs equal up to FP32 summation order; and, on a
Hopper GPU, against torch._scaled_mm with 1x128 x 128x128 blockwise scales. Runs on CPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax import hf, ops, quant, recipes  # noqa: E402
from fp8jax.model import llama  # noqa: E402

E4M3_MAX = 448.0
BLOCK = 128


# ------------------------------------------------------------------------------------------------------------------
# The two engines
# ------------------------------------------------------------------------------------------------------------------


def torch_outputs(hf_dir: str, tokens_BxT: np.ndarray, dtype: str = "float32"):
  """transformers' model -> (logits f32 (B, T, V), [residual stream after embedding, after each layer] f32)."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
  model.eval()
  with torch.no_grad():
    out = model(torch.as_tensor(tokens_BxT, dtype=torch.long), output_hidden_states=True)
  n = model.config.num_hidden_layers
  hs = [h.float().numpy() for h in out.hidden_states]
  # transformers returns L+1 states; in Llama/Qwen3 the last one is after the final norm: recompute the pre-norm one
  # from a hook so every entry is a residual stream (as fp8jax's forward(..., residuals=True) returns).
  if len(hs) == n + 1:
    captured = {}
    layer = model.model.layers[n - 1]
    handle = layer.register_forward_hook(lambda m, i, o: captured.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
      model(torch.as_tensor(tokens_BxT, dtype=torch.long))
    handle.remove()
    hs[-1] = captured["x"].float().numpy()
  return out.logits.float().numpy(), hs


def fp8jax_outputs(params, cfg, tokens_BxT: np.ndarray, recipe: recipes.Recipe):
  """fp8jax with ``recipe`` -> (logits f32, residual stream list f32). FP8: the sampler's quantize_params weights."""
  run_params = recipes.quantize_params(params, recipe) if recipe.mode == "fp8" else params
  lcfg = ops.LinearConfig.from_recipe(recipe)

  @jax.jit
  def run(p, toks):
    hidden, _, aux = llama.forward(p, toks, cfg, lcfg, residuals=True)
    return llama.logits(p, hidden, cfg, lcfg), list(aux.residuals)

  logits, hs = run(run_params, jnp.asarray(tokens_BxT))
  return np.asarray(logits, np.float32), [np.asarray(h, np.float32) for h in hs]


# ------------------------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------------------------


def _log_softmax(x):
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logit_stats(ref_BxTxV: np.ndarray, got_BxTxV: np.ndarray) -> dict:
  """max/mean |diff|, KL(ref || got) per token (mean, max) and top-1 agreement."""
  d = np.abs(ref_BxTxV.astype(np.float64) - got_BxTxV)
  lp, lq = _log_softmax(ref_BxTxV), _log_softmax(got_BxTxV)
  kl = (np.exp(lp) * (lp - lq)).sum(-1)
  return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "kl_mean": float(kl.mean()),
          "kl_max": float(kl.max()), "top1": float((ref_BxTxV.argmax(-1) == got_BxTxV.argmax(-1)).mean())}


def hidden_rel_errors(ref: list[np.ndarray], got: list[np.ndarray]) -> list[float]:
  """||got - ref|| / ||ref|| per residual-stream entry (embedding, layer 0, ..., layer L-1)."""
  return [float(np.linalg.norm(g.astype(np.float64) - r) / max(np.linalg.norm(r.astype(np.float64)), 1e-30))
          for r, g in zip(ref, got, strict=True)]


# ------------------------------------------------------------------------------------------------------------------
# Block-FP8 linear in PyTorch (the numerics contract of docs/design.md, written independently of fp8jax)
# ------------------------------------------------------------------------------------------------------------------


def torch_quantize_blocks(x, rows: int):
  """E4M3 block quantization of a 2-D float32 tensor with (rows x 128) blocks -> (q e4m3, scale f32 per block)."""
  import torch  # noqa: PLC0415

  n, k = x.shape
  nb, kb = -(-n // rows), -(-k // BLOCK)
  xp = torch.zeros(nb * rows, kb * BLOCK, dtype=torch.float32)
  xp[:n, :k] = x.float()
  tiles = xp.reshape(nb, rows, kb, BLOCK)
  finite = torch.where(torch.isfinite(tiles), tiles.abs(), torch.zeros_like(tiles))
  scale = torch.clamp(finite.amax(dim=(1, 3)), min=quant.AMAX_FLOOR) / E4M3_MAX  # (nb, kb)
  scaled = tiles / scale[:, None, :, None]
  q = torch.where(torch.isfinite(scaled), scaled.clamp(-E4M3_MAX, E4M3_MAX), torch.nan).to(torch.float8_e4m3fn)
  return q.reshape(nb * rows, kb * BLOCK)[:n, :k], scale


def torch_block_fp8_linear(x_MxK, w_NxK):
  """y = Q(x)[1x128] . Q(w)[128x128]^T with FP32 accumulation per 128-wide K block, blocks summed in K order."""
  import torch  # noqa: PLC0415

  xq, xs_MxKb = torch_quantize_blocks(x_MxK, 1)
  wq, ws_NbxKb = torch_quantize_blocks(w_NxK, BLOCK)
  (m, k), n = x_MxK.shape, w_NxK.shape[0]
  ws_NxKb = ws_NbxKb.repeat_interleave(BLOCK, dim=0)[:n]
  acc = torch.zeros(m, n, dtype=torch.float32)
  for kb in range(-(-k // BLOCK)):  # a ragged last block counts as zero-padded (its scale covers what is there)
    sl = slice(kb * BLOCK, min((kb + 1) * BLOCK, k))
    acc += (xq[:, sl].float() @ wq[:, sl].float().T) * (xs_MxKb[:, kb, None] * ws_NxKb[None, :, kb])
  return acc, (xq, xs_MxKb, wq, ws_NbxKb)


def compare_block_linear(m: int = 64, k: int = 512, n: int = 384, seed: int = 0, w_NxK=None) -> dict:
  """fp8jax's FP8 linear (XLA reference backend) vs the PyTorch block math above, on the same inputs."""
  import torch  # noqa: PLC0415

  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))).astype(np.float32)
  w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32) if w_NxK is None else np.asarray(w_NxK, np.float32)
  n, k = w.shape
  x = x[:, :k] if x.shape[1] >= k else np.pad(x, ((0, 0), (0, k - x.shape[1])))
  qw = quant.quantize_weight(jnp.asarray(w))
  xq, xs = quant.quantize_act(quant.pad_k(jnp.asarray(x)))  # K not a multiple of 128: zero-padded, as ops.linear
  xq = xq[:, :k]
  y_jax = np.asarray(ops.linear(jnp.asarray(x), qw, ops.LinearConfig(backend="xla", out_dtype="float32")))
  y_t, (txq, txs, twq, tws) = torch_block_fp8_linear(torch.from_numpy(x.copy()), torch.from_numpy(w.copy()))
  y_t = y_t.numpy()
  same = lambda a, b: bool(np.array_equal(np.asarray(a).view(np.uint8), b.view(torch.uint8).numpy()))  # noqa: E731
  res = {
      "shape": f"x {m}x{k} . w {n}x{k}^T",
      "weight_q_bitwise": same(qw.q, twq), "act_q_bitwise": same(xq, txq),
      # XLA rewrites amax / 448 as amax * fl(1/448), so fp8jax's scales can sit 1 ulp from torch's true division.
      "weight_scale_max_ulp": _max_ulp(np.asarray(qw.scale), tws.numpy()),
      "act_scale_max_ulp": _max_ulp(np.asarray(xs), txs.numpy()),
      "max_abs": float(np.abs(y_jax - y_t).max()),
      "max_rel": float(np.abs(y_jax - y_t).max() / np.abs(y_t).max()),
  }
  res.update(scaled_mm_check(x, w))
  return res


def _max_ulp(a: np.ndarray, b: np.ndarray) -> int:
  """Largest distance in float32 ulps between two same-signed float32 arrays."""
  return int(np.abs(a.astype(np.float32).view(np.int32).astype(np.int64) - b.astype(np.float32).view(np.int32)).max())


def scaled_mm_check(x: np.ndarray, w: np.ndarray) -> dict:
  """On an sm_90 GPU: torch._scaled_mm with 1x128 (activations) x 128x128 (weights) scales vs the torch block math."""
  import torch  # noqa: PLC0415

  if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    return {"scaled_mm": "skipped (needs a CUDA sm_90 GPU)"}
  try:
    xt, wt = torch.from_numpy(x.copy()), torch.from_numpy(w.copy())
    ref, (xq, xs_MxKb, wq, ws_NbxKb) = torch_block_fp8_linear(xt, wt)
    dev = "cuda"
    a = xq.to(dev)  # (M, K) row-major
    b = wq.to(dev).t()  # (K, N) column-major: the (N, K) weight as stored
    sa = xs_MxKb.to(dev).t().contiguous().t()  # (M, Kb), M-major ("outer-dim-major") as cuBLAS wants
    sb = ws_NbxKb.to(dev).t()  # (Kb, Nb)
    try:
      y = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    except RuntimeError:
      y = torch._scaled_mm(a, b, sa, sb.contiguous(), out_dtype=torch.bfloat16).float()
    y = y.cpu()
    return {"scaled_mm_max_rel": float((y - ref).abs().max() / ref.abs().max())}
  except Exception as e:  # noqa: BLE001 (report, never hide)
    return {"scaled_mm": f"failed: {type(e).__name__}: {e}"[:300]}


# ------------------------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------------------------


def make_tokens(hf_dir: str, prompts: list[str] | None, batch: int, seq: int, vocab: int, seed: int):
  if prompts:
    tok = hf.load_tokenizer(hf_dir)
    return [np.asarray([tok.encode(p)], np.int32) for p in prompts]  # one row per prompt: no padding to reason about
  return [np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)]


def compare(hf_dir: str, prompts=None, batch: int = 2, seq: int = 64, seed: int = 0, torch_bf16: bool = True,
            result: dict | None = None):
  """Runs every row of the module docstring; returns {row: {"logits": stats, "hidden_rel": [...]}, "block_linear": ...}.

  ``result``: a dict filled in as the rows complete, so a caller still has them when a later row raises.
  """
  result = {} if result is None else result
  cfg = hf.load_config(hf_dir)
  params = hf.load_params(hf_dir, cfg)
  rows = {"fp8jax-bf16": recipes.Recipe(mode="bf16", gemm_backend="xla"),
          "fp8jax-fp8": recipes.Recipe(mode="fp8", gemm_backend="xla")}
  runs = {name: functools.partial(fp8jax_outputs, params, cfg, recipe=r) for name, r in rows.items()}
  if torch_bf16:
    runs = {"torch-bf16": lambda toks: torch_outputs(hf_dir, toks, "bfloat16"), **runs}
  token_sets = make_tokens(hf_dir, prompts, batch, seq, cfg.vocab_size, seed)
  refs = [torch_outputs(hf_dir, toks, "float32") for toks in token_sets]
  for name, run in runs.items():  # one row at a time, each complete in ``result`` before the next starts
    ref_l, got_l, h = [], [], []
    for toks, (ref_logits, ref_h) in zip(token_sets, refs):
      lg, hs = run(toks)
      ref_l.append(ref_logits.reshape(-1, ref_logits.shape[-1]))
      got_l.append(lg.reshape(-1, lg.shape[-1]))
      h.append(hidden_rel_errors(ref_h, hs))
    result[name] = {"logits": logit_stats(np.concatenate(ref_l), np.concatenate(got_l)),
                    "hidden_rel": np.max(np.asarray(h), axis=0).tolist()}
  w_up = np.asarray(params["layers"][0]["w_up"])
  result["block_linear"] = compare_block_linear(w_NxK=w_up, seed=seed)
  return result


def print_report(r: dict):
  print(f"{'row':<12} {'max|dl|':>9} {'mean|dl|':>9} {'KL mean':>9} {'KL max':>9} {'top1':>6}  hidden rel err "
        "(emb, layer 0..L-1)")
  for name, v in r.items():
    if name == "block_linear":
      continue
    s = v["logits"]
    hid = " ".join(f"{e:.1e}" for e in v["hidden_rel"])
    print(f"{name:<12} {s['max_abs']:9.2e} {s['mean_abs']:9.2e} {s['kl_mean']:9.2e} {s['kl_max']:9.2e} "
          f"{s['top1']:6.3f}  {hid}")
  if "block_linear" not in r:
    return
  print("block-FP8 linear, fp8jax vs PyTorch block math:")
  for k, v in r["block_linear"].items():
    print(f"  {k}: {v}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hf_dir", help="local HF model directory (safetensors)")
  ap.add_argument("--make_tiny", metavar="DIR", help="write a random tiny HF model here (and compare it)")
  ap.add_argument("--arch", default="llama", choices=["llama", "qwen3"], help="architecture for --make_tiny")
  ap.add_argument("--prompts", nargs="*", help="prompts to run (default: random tokens)")
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=64)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--no_torch_bf16", action="store_true", help="skip the transformers-bf16 yardstick row")
  args = ap.parse_args(argv)
  if args.make_tiny:
    hf.make_tiny_hf_dir(args.make_tiny, args.arch, seed=args.seed)
    print(f"wrote a tiny random {args.arch} HF directory to {args.make_tiny}")
    args.hf_dir = args.hf_dir or args.make_tiny
  if not args.hf_dir:
    ap.error("--hf_dir (or --make_tiny) is required")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; fp8 gemm backend: xla reference")
  result: dict = {}
  try:
    compare(args.hf_dir, args.prompts, args.batch, args.seq, args.seed, not args.no_torch_bf16, result=result)
  except BaseException:
    if result:
      print("(stopped by the error below; the rows computed so far:)")
      print_report(result)
    raise
  print_report(result)


if __name__ == "__main__":
  main()
