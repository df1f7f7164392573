"""Convert between Hugging Face directories and fp8jax orbax checkpoints (logic in fp8jax.hf).

  HF -> orbax (for training):
    python scripts/convert.py --from_hf /models/Llama-3.1-8B-Instruct --to_ckpt /ckpt/llama8b
  orbax -> HF BF16 or block-FP8 (for transformers / vLLM / SGLang):
    python scripts/convert.py --from_ckpt /ckpt/llama8b --to_hf /out/llama8b-bf16 --format bf16
    python scripts/convert.py --from_ckpt /ckpt/llama8b --to_hf /out/llama8b-fp8 --format fp8 [--keep_first_n 1]

A checkpoint directory holds ``params/`` (the orbax PyTree of FP32 master params) and ``hf/`` (the source
config.json, generation_config.json and tokenizer files), so ``--config`` and ``--tokenizer_dir`` default to
``<ckpt>/hf``. ``--config`` may also name an HF config.json / HF directory, or a configs/*.py whose get_config()
has ``model`` (and, for ``--format fp8``, ``fp8``) groups.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp8jax  # noqa: E402

fp8jax.configure_xla()  # XLA flags for every program of the process, before JAX starts its backend
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fp8jax import hf, recipes  # noqa: E402
from fp8jax.config_utils import load_config_file  # noqa: E402
from fp8jax.model import ModelConfig, param_shapes  # noqa: E402

PARAMS_SUBDIR, HF_SUBDIR = "params", "hf"


def _checkpointer():
  import orbax.checkpoint as ocp  # noqa: PLC0415

  return ocp.StandardCheckpointer()


def hf_to_ckpt(hf_dir: str, ckpt_dir: str, pow2_scales: bool = False) -> ModelConfig:
  """HF directory -> ``ckpt_dir/params`` (orbax, FP32) + ``ckpt_dir/hf`` (config and tokenizer files).

  A block-FP8 source loads as master weights that requantize to its exact codes and scales (with ``pow2_scales``
  for a power-of-two recipe; see fp8jax.hf.block_fp8_master).
  """
  cfg = hf.load_config(hf_dir)
  params = hf.load_params(hf_dir, cfg, dtype=jnp.float32, pow2_scales=pow2_scales)
  os.makedirs(ckpt_dir, exist_ok=True)
  ckptr = _checkpointer()
  ckptr.save(os.path.abspath(os.path.join(ckpt_dir, PARAMS_SUBDIR)), params)
  ckptr.wait_until_finished()
  meta = os.path.join(ckpt_dir, HF_SUBDIR)
  os.makedirs(meta, exist_ok=True)
  for fname in (hf.CONFIG_FILE, *hf.TOKENIZER_FILES):
    if os.path.isfile(os.path.join(hf_dir, fname)):
      shutil.copyfile(os.path.join(hf_dir, fname), os.path.join(meta, fname))
  return cfg


def load_model_config(path: str) -> tuple[ModelConfig, recipes.Recipe | None]:
  """HF config.json / HF dir, or a configs/*.py with get_config() -> (ModelConfig, fp8 Recipe or None)."""
  if path.endswith(".py"):
    c = load_config_file(path)
    recipe = recipes.Recipe.from_config(c.fp8) if "fp8" in c else None
    return ModelConfig.from_config(c.model), recipe
  return hf.load_config(os.path.dirname(path) if path.endswith(".json") else path), None


def load_ckpt_params(ckpt_dir: str, cfg: ModelConfig) -> dict:
  shapes = param_shapes(cfg)
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
  path = os.path.join(ckpt_dir, PARAMS_SUBDIR)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path}: orbax params directory not found")
  return _checkpointer().restore(os.path.abspath(path), abstract)


def ckpt_to_hf(ckpt_dir: str, out_dir: str, fmt: str = "bf16", config: str | None = None,
               tokenizer_dir: str | None = None, recipe: recipes.Recipe | None = None,
               ragged_fp8: bool = False) -> None:
  meta = os.path.join(ckpt_dir, HF_SUBDIR)
  cfg, cfg_recipe = load_model_config(config or meta)
  tokenizer_dir = tokenizer_dir or (meta if os.path.isdir(meta) else None)
  params = load_ckpt_params(ckpt_dir, cfg)
  if fmt == "bf16":
    hf.export_bf16(params, cfg, out_dir, tokenizer_dir)
  elif fmt == "fp8":
    hf.export_fp8(params, cfg, recipe or cfg_recipe or recipes.Recipe(mode="fp8"), out_dir, tokenizer_dir,
                  ragged_fp8=ragged_fp8)
  else:
    raise ValueError(f"--format must be 'bf16' or 'fp8', got {fmt!r}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--from_hf")
  ap.add_argument("--to_ckpt")
  ap.add_argument("--from_ckpt")
  ap.add_argument("--to_hf")
  ap.add_argument("--format", default="bf16", choices=["bf16", "fp8"])
  ap.add_argument("--config", help="HF config.json/dir or configs/*.py (default: <ckpt>/hf)")
  ap.add_argument("--tokenizer_dir", help="tokenizer files to copy (default: <ckpt>/hf)")
  ap.add_argument("--keep_first_n", type=int, default=None, help="fp8: first layers kept in BF16")
  ap.add_argument("--keep_last_n", type=int, default=None, help="fp8: last layers kept in BF16")
  ap.add_argument("--pow2_scales", action="store_true",
                  help="fp8: power-of-two scales (with --from_hf: match a block-FP8 source's pow2 scales exactly)")
  ap.add_argument("--ragged_fp8", action="store_true",
                  help="fp8: keep weights with a dim not a multiple of 128 in FP8 (transformers 5.17 misreads them; "
                       "by default they are written BF16)")
  args = ap.parse_args(argv)
  if args.from_hf and args.to_ckpt:
    cfg = hf_to_ckpt(args.from_hf, args.to_ckpt, pow2_scales=args.pow2_scales)
    print(f"wrote {args.to_ckpt}/{PARAMS_SUBDIR} ({cfg.n_layers} layers, dim {cfg.dim})")
  elif args.from_ckpt and args.to_hf:
    recipe = None
    if args.keep_first_n is not None or args.keep_last_n is not None or args.pow2_scales:
      recipe = recipes.Recipe(mode="fp8", keep_first_n=args.keep_first_n or 0, keep_last_n=args.keep_last_n or 0,
                            pow2_scales=args.pow2_scales)
    ckpt_to_hf(args.from_ckpt, args.to_hf, args.format, args.config, args.tokenizer_dir, recipe, args.ragged_fp8)
    print(f"wrote {args.format} HF directory {args.to_hf}")
  else:
    ap.error("give --from_hf DIR --to_ckpt DIR, or --from_ckpt DIR --to_hf DIR")


if __name__ == "__main__":
  main()
