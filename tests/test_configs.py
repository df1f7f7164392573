"""Every recipe in configs/: it loads and passes the trainer's checks, each FP8 recipe has its BF16 twin, and each
large recipe's memory plan fits the hardware its docstring names (the exact rows, on the CPU, from shapes alone:
no weights, no data)."""

import importlib
import os

import pytest

import child_process
from fp8jax import lora
from fp8jax.config_utils import dataclass_from_group
from fp8jax.model.config import ModelConfig
from fp8jax.rl import trainer as trainer_lib
from fp8jax.rl.learner import GRPOConfig, OptimConfig

CONFIGS = os.path.join(child_process.REPO, "configs")
NAMES = sorted(f[:-3] for f in os.listdir(CONFIGS) if f.endswith(".py") and f not in ("__init__.py", "common.py"))

# The hardware each large recipe's docstring names: (devices, GiB per device its allocator may use). An 80 GB H100
# gives JAX 76 GiB at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the LoRA recipes' command); an H200 139.
H100, H200 = 76, 139
HARDWARE = {
    "llama8b_fp8": (8, H100), "llama8b_bf16": (8, H100),  # "8x H100/H200"
    "llama8b_fp8_lora": (1, H100), "llama8b_bf16_lora": (1, H100),
    "qwen3_8b_fp8_lora": (1, H100), "qwen3_8b_bf16_lora": (1, H100),
    "llama8b_fp8_1gpu": (1, H200), "llama8b_bf16_1gpu": (1, H200),
    "qwen3_8b_fp8_1gpu": (1, H200), "qwen3_8b_bf16_1gpu": (1, H200),
    "qwen3_30b_a3b_fp8": (8, H200), "qwen3_30b_a3b_bf16": (8, H200),
    "moonlight16b_fp8": (8, H200), "moonlight16b_bf16": (8, H200),
}
SMALL = ("tiny_fp8", "tiny_bf16", "tiny_moe_fp8", "tiny_moe_bf16", "smollm2_asdiv_fp8", "smollm2_asdiv_bf16")


def _config(name):
  return importlib.import_module(f"configs.{name}").get_config()


def test_every_recipe_is_listed_here():
  """A new recipe must say which hardware its plan is checked for (HARDWARE) or be one of the small ones."""
  assert sorted(set(HARDWARE) | set(SMALL)) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_recipe_loads_and_passes_the_trainers_checks(name):
  c = _config(name)
  trainer_lib.validate_config(c)  # each failure names its key
  dataclass_from_group(OptimConfig, c.optim, "optim")  # the groups' own checks (unknown keys, ranges)
  dataclass_from_group(GRPOConfig, c.grpo, "grpo")
  lcfg = lora.LoRAConfig.from_config(c)
  if not c.checkpoint.hf_dir:  # an HF checkpoint brings its own architecture
    lcfg.check_model(ModelConfig.from_config(c.model))
  assert c.workdir == f"runs/{name}", "each recipe writes to its own runs/ directory"


@pytest.mark.parametrize("name", [n for n in NAMES if "_fp8" in n])
def test_every_fp8_recipe_has_a_bf16_twin_that_differs_in_the_recipe_only(name):
  """The README's promise: `*_bf16*` runs the same model, task, batch and schedule without quantization. A twin may
  use fewer decode slots (its KV pages are twice as large) and keep its optimizer state elsewhere (optim.offload)."""
  fp8, bf16 = _config(name), _config(name.replace("_fp8", "_bf16"))
  assert (fp8.fp8.mode, bf16.fp8.mode) == ("fp8", "bf16")
  assert bf16.fp8.kv_cache == "bf16"
  flat = lambda c, skip: {  # noqa: E731
      f"{g}.{k}": v for g, grp in c.items() if hasattr(grp, "items") and g != "fp8" for k, v in grp.items()
      if f"{g}.{k}" not in skip}
  allowed = {"rollout.slots", "optim.offload"}
  a, b = flat(fp8, allowed), flat(bf16, allowed)
  assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
  assert {k: v for k, v in fp8.items() if not hasattr(v, "items") and k != "workdir"} == \
      {k: v for k, v in bf16.items() if not hasattr(v, "items") and k != "workdir"}


PLAN_SCRIPT = """
import importlib
import jax
from fp8jax import kvcache
from fp8jax.rl import memory
from fp8jax.rl.trainer import memory_plan

out = {}
for name, (n, gib) in %r.items():
  c = importlib.import_module("configs." + name).get_config()
  with kvcache.gpu_pages():  # the GPU's KV pages, as scripts/plan_memory.py --devices plans them
    p = memory_plan(c, devices=jax.devices()[:n], temporaries=False, target="gpu")
  try:
    memory.check(p, int(gib * memory.GIB))
    verdict = "fits"
  except memory.DoesNotFit as e:
    verdict = str(e)
  out[name] = dict(peak=p.peak(exact_only=True) / memory.GIB, verdict=verdict, mesh=p.mesh)
report(out)
"""


def test_large_recipes_fit_the_hardware_they_name():
  """The plan's exact rows (state, sampler weights, KV pool, gradients) fit each recipe's named GPU; XLA's compiled
  temporaries come on top and are checked by the trainer on the GPU itself. Where a recipe shards (8 GPUs), the plan
  is made on 8 fake devices with the recipe's own mesh."""
  out = child_process.run(PLAN_SCRIPT % HARDWARE, devices=8, timeout=900)
  for name, (n, gib) in HARDWARE.items():
    got = out[name]
    assert got["verdict"] == "fits", f"{name} on {n} x {gib} GiB: {got['verdict']}"
    assert 0.2 * gib < got["peak"] <= gib, (name, got["peak"])  # a plan of nothing (e.g. no KV pool) would pass 'fits'
    assert max(got["mesh"].values()) <= n
