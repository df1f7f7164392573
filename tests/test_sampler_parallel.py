"""Data-parallel rollouts (``fp8jax.sampler.Sampler``, "data-parallel rollouts"): on a mesh without tensor
parallelism each device generates its own share of the requests with its own slots and KV pages. Run in a subprocess
with 8 fake CPU devices (XLA_FLAGS must be set before JAX starts)."""

import jax
import numpy as np
import pytest

from fp8jax import backends, sharding
from fp8jax.diagnostics import one_engine
import child_process  # tests/child_process.py

SCRIPT = r"""
import dataclasses
import jax, numpy as np
from fp8jax import sampler as S, ops, sharding, quant
from fp8jax import recipes
from fp8jax.model import llama
from fp8jax.model.config import ModelConfig
from configs import tiny_fp8

c = tiny_fp8.get_config()
cfg = ModelConfig.from_config(c.model)
recipe = recipes.Recipe.from_config(c.fp8)
sparams = S.prepare_params(llama.init_params(cfg, seed=0), recipe)
# 5 prompts of 3-7 tokens: shares of 1 or 2 prompts, the last one padded
prompts = [[1 + (i * 7 + j) % 60 for j in range(3 + i % 5)] for i in range(5)]
sampled = S.SamplingParams(max_new_tokens=6, seed=3)
greedy = S.SamplingParams(max_new_tokens=6, greedy=True, stop_token_ids=(5, 9))
scfg = S.SamplerConfig(slots=8, max_len=16, prompt_buckets=(16,), kv_cache="fp8", decode_chunk=4)
lcfg = ops.LinearConfig.from_recipe(recipe)
ks = (np.full(cfg.n_layers, 0.05, np.float32), np.full(cfg.n_layers, 0.04, np.float32))

def run(tag, mesh_cfg, **scfg_changes):
  s = dataclasses.replace(scfg, **scfg_changes)
  if mesh_cfg is None:
    sampler, p = S.Sampler(cfg, s, lcfg), sparams
  else:
    n = int(np.prod(list(mesh_cfg.values())))
    mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:n])
    sampler = S.Sampler(cfg, s, dataclasses.replace(lcfg, mesh=mesh))
    p = jax.device_put(sparams, sharding.tree_shardings(sparams, mesh))
  out = {{}}
  scales = sampler.calibrate_kv_scales(p, prompts, 1.25)
  np.savez(os.path.join({tmp!r}, f"{{tag}}_scales.npz"), k=np.asarray(scales[0]), v=np.asarray(scales[1]))
  for name, sp, n in (("sampled", sampled, 3), ("greedy", greedy, 1)):
    ro = sampler.generate(p, prompts, sp, n=n, kv_scales=ks)
    np.savez(os.path.join({tmp!r}, f"{{tag}}_{{name}}.npz"),
             tokens=ro.tokens, logprobs=ro.logprobs, lengths=ro.lengths, finish=ro.finish_reason,
             prompt_idx=ro.prompt_idx)
    out[name] = {{k: ro.stats[k] for k in ("rollout_devices", "kv_pages", "generated_tokens", "decode_steps")}}
  return out

res = {{}}
for tag, mesh_cfg, changes in (("one", None, {{}}), ("fsdp8", dict(fsdp=8), {{}}),
                               ("data2_fsdp2", dict(data=2, fsdp=2), {{}}),
                               ("fsdp8_spmd", dict(fsdp=8), dict(data_parallel=False)),
                               ("fsdp2_tensor2", dict(fsdp=2, tensor=2), {{}})):
  res[tag] = run(tag, mesh_cfg, **changes)
try:
  run("bad", dict(fsdp=8), slots=12)
  res["bad_slots"] = "no error"
except ValueError as e:
  res["bad_slots"] = str(e)
report(res)
"""


def test_data_parallel_rollouts_equal_one_device(tmp_path):
  """Sampled (3 samples per prompt, FP8 KV) and greedy (stop ids) rollouts of 5 prompts on 8 devices (fsdp 8: one
  slot per device; the last shares padded) and on 4 (data 2 x fsdp 2): tokens, log-probs, lengths and finish reasons
  bitwise the one-device sampler's (and the FP8 KV scales' calibration), each device holding only its share's pages. The switch (data_parallel=False) and
  the tensor-parallel mesh take the one-program path: the same tokens, log-probs within 1e-5 (not bitwise there on
  CPU). Slots that the devices do not divide are refused, naming the key."""
  out = child_process.run(SCRIPT.format(tmp=str(tmp_path)), devices=8)
  assert {k: out[k]["sampled"]["rollout_devices"] for k in out if k != "bad_slots"} == {
      "one": 1, "fsdp8": 8, "data2_fsdp2": 4, "fsdp8_spmd": 1, "fsdp2_tensor2": 1}
  # every device holds its share's pages only: 1 prompt + 1 slot of own pages on 8 devices, 2 + 2 on 4
  assert out["fsdp8"]["sampled"]["kv_pages"] < out["data2_fsdp2"]["sampled"]["kv_pages"] < \
      out["one"]["sampled"]["kv_pages"]
  for name in ("sampled", "greedy"):
    ref = dict(np.load(tmp_path / f"one_{name}.npz"))
    assert ref["tokens"].shape[0] == (15 if name == "sampled" else 5)
    assert out["one"][name]["generated_tokens"] > 0
    for tag in ("fsdp8", "data2_fsdp2", "fsdp8_spmd", "fsdp2_tensor2"):
      got = dict(np.load(tmp_path / f"{tag}_{name}.npz"))
      for field in ref:
        assert got[field].dtype == ref[field].dtype, (name, tag, field)
        if field == "logprobs" and tag.endswith(("spmd", "tensor2")):
          # one program over the mesh: XLA partitions and fuses the output head itself, and on CPU its log-probs
          # can move by an ulp (seen: 4.1122217 vs 4.112222); the data-parallel shares are bitwise
          np.testing.assert_allclose(got[field], ref[field], rtol=0, atol=1e-5, err_msg=f"{name} {tag}")
        else:
          assert np.array_equal(got[field], ref[field]), (name, tag, field)
  ref = np.load(tmp_path / "one_scales.npz")
  for tag in ("fsdp8", "data2_fsdp2", "fsdp8_spmd", "fsdp2_tensor2"):  # the KV scales' calibration prefill
    got = np.load(tmp_path / f"{tag}_scales.npz")
    for field in ("k", "v"):
      np.testing.assert_allclose(got[field], ref[field], rtol=0 if tag in ("fsdp8", "data2_fsdp2") else 1e-6)
  assert "rollout.slots=12 must be a multiple of the 8 devices" in out["bad_slots"], out["bad_slots"]


@pytest.mark.gpu
@pytest.mark.skipif(not (backends.hopper_available() and len(jax.devices()) >= 2), reason="needs >= 2 Hopper GPUs")
@pytest.mark.parametrize("recipe", ["bf16", "fp8+kv"])
def test_gpu_data_parallel_rollouts_are_the_trainers_on_real_gpus(recipe):
  """Data-parallel rollouts over every local GPU (fsdp axis) with the Hopper kernels: sampler == trainer (on one GPU)
  exactly, every log-prob bitwise, as on one GPU (test_one_engine's small workload, 16 prompts x 2 samples)."""
  cfg = one_engine.model_config(1024, 2, 32768)
  prompts = [np.random.default_rng(i).integers(0, 32768, size=8 + 3 * i).tolist() for i in range(16)]
  mesh = sharding.make_mesh({"fsdp": -1})
  m = one_engine.sampler_vs_trainer(cfg, one_engine.promised_recipes()[recipe], prompts, slots=32, samples=2, max_new=32,
                                    mesh=mesh)
  assert m["rollout_devices"] == len(jax.devices()), m
  assert m["token_mult_prob_error"] == 1.0 and m["bitwise_equal_frac"] == 1.0, m
