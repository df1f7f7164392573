"""Registers, shared memory and SASS instruction mix of the attention kernels for sm_90, on a machine without a GPU.

  python3 scripts/triton_resources.py [--kernel decode|decode_shared|seq] [--kv fp8_pairs|fp8|bf16] [--sass_out DIR]

Lowers the kernel's pallas_call for an abstract H200 (``pallas_kernels.lowering``, as the CPU lowering tests do),
takes the Triton module that jax's Pallas Triton lowering builds, and compiles it with the pinned ``triton`` package
(its own ptxas) for sm_90 with the kernel's num_warps / num_stages. Prints, per Triton kernel of the call: registers per
thread, spill stack, dynamic shared memory, how many programs (of the kernel's warps) fit on one SM by registers and by
shared memory (or that the kernel exceeds the per-block limit and cannot launch), and the most frequent SASS opcodes
(static count, not executed).

What it is for: the decode tile's speed follows its occupancy (docs/history.md, "Tried and dropped"), which a
register or shared-memory change moves by a whole program per SM; this shows it before spending device time. XLA
compiles the same module with the Triton it bundles, not this one: checked on 2026-12-04 against the H200 profile of
the FP8 + FP8 KV decode step (both 255 registers and 114,688 bytes of shared memory for ``fp8jax_attention_decode``).
Treat a difference as a question for the device (Nsight Compute), not as an answer.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: E402

from pallas_kernels import attention_triton as kern  # noqa: E402
from pallas_kernels.lowering import lower_for_h200  # noqa: E402

SM_REGISTERS, SM_SHARED, MAX_SHARED_PER_BLOCK = 65536, 228 * 1024, 227 * 1024


def triton_modules(fn, *args):
  """[(name, Triton IR text, num_warps, num_stages)] of every Pallas Triton kernel ``fn(*args)`` lowers to, in the
  order of the lowered module's custom calls."""
  captured, lower = [], registration.lowering.lower_jaxpr_to_triton_module

  def keep(*a, **k):
    r = lower(*a, **k)
    captured.append(r.module.operation.get_asm(enable_debug_info=False))
    return r

  registration.lowering.lower_jaxpr_to_triton_module = keep
  try:
    text = lower_for_h200(fn, *args)
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  configs = re.findall(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
  if len(configs) != len(captured):
    raise RuntimeError(f"{len(captured)} Triton modules but {len(configs)} launch configs in the lowered text")
  return [(name, ir, int(warps), int(stages)) for ir, (name, stages, warps) in zip(captured, configs)]


def compile_sm90(ir_text: str, num_warps: int, num_stages: int, sass_path: str | None = None) -> dict:
  """Compiles Triton IR text for sm_90 -> {registers, stack, shared (bytes), programs_by_registers,
  programs_by_shared, fits_shared (within the per-block limit), top_opcodes, sass_instructions}; the SASS listing
  goes to ``sass_path`` if given."""
  import triton  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415

  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ir_text)
    compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    cubin = os.path.join(tmp, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(compiled.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                           text=True, check=True).stdout
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
  regs = int(re.search(r"REG:(\d+)", usage).group(1))
  stack = int(re.search(r"STACK:(\d+)", usage).group(1))
  shared = int(compiled.metadata.shared)
  threads = 32 * num_warps
  by_regs = SM_REGISTERS // (-(-regs // 8) * 8 * threads)
  by_shared = SM_SHARED // (shared + 1024) if shared else 32  # + the 1 KB per block the driver reserves
  ops = collections.Counter()
  for line in sass.splitlines():
    m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
    if m:
      ops[m.group(1)] += 1
  if sass_path:
    with open(sass_path, "w") as f:
      f.write(sass)
  return dict(registers=regs, stack=stack, shared=shared, programs_by_registers=by_regs,
              programs_by_shared=by_shared, fits_shared=shared <= MAX_SHARED_PER_BLOCK,
              top_opcodes=ops.most_common(12), sass_instructions=sum(ops.values()))


def kernel_args(kernel: str, kv: str):
  """(function, abstract args) of the decode step's launch at Llama-3.1-8B shapes (256 slots, paged) or of the
  training forward (8 x 4096). ``kv``: fp8_pairs (the sampler's pair-ordered FP8 cache), fp8 (natural order), bf16."""
  S = jax.ShapeDtypeStruct
  f32, i32, bf = jnp.float32, jnp.int32, jnp.bfloat16
  kv_dtype = {"fp8": jnp.float8_e4m3fn, "fp8_pairs": jnp.float8_e4m3fn, "bf16": bf}[kv]
  h, n_kv, d = 32, 8, 128
  sc = (S((), f32), S((), f32))
  if kernel == "seq":
    kv_dtype = jnp.float16 if kv == "fp8" else bf  # the trainer's codes reach the kernel as FP16
    return kern.attention_seq, (S((8, 4096, h, d), bf), S((8, 4096, n_kv, d), kv_dtype),
                                S((8, 4096, n_kv, d), kv_dtype), S((8, 4096), i32), *sc)
  pool = S((3000, kern.BLOCK_KV, n_kv, d), kv_dtype)
  table = S((256, -(-1536 // kern.BLOCK_KV)), i32)
  shared = (S((256,), i32),) if kernel == "decode_shared" else ()
  fn = functools.partial(kern.attention_heads, pair_ordered=kv == "fp8_pairs")
  return fn, (S((256, h, d), bf), pool, pool, S((256,), i32), *sc, table, *shared)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--kernel", default="decode_shared", choices=("decode", "decode_shared", "seq"))
  p.add_argument("--kv", default="fp8_pairs", choices=("fp8_pairs", "fp8", "bf16"),
                 help="fp8_pairs: the sampler's FP8 cache (pair order); fp8: codes in natural order")
  p.add_argument("--sass_out", default=None, help="directory for each kernel's SASS listing")
  a = p.parse_args()
  fn, args = kernel_args(a.kernel, a.kv)
  for i, (name, text, warps, stages) in enumerate(triton_modules(fn, *args)):
    sass = os.path.join(a.sass_out, f"{name}_{i}.sass") if a.sass_out else None
    r = compile_sm90(text, warps, stages, sass)
    print(f"{name}: {warps} warps, {stages} stages | {r['registers']} registers, stack {r['stack']} B, "
          f"shared {r['shared']} B | programs per SM: {r['programs_by_registers']} by registers, "
          f"{r['programs_by_shared']} by shared memory | {r['sass_instructions']} SASS instructions"
          + ("" if r["fits_shared"] else f" | OVER the {MAX_SHARED_PER_BLOCK} B per-block limit: cannot launch"))
    print("  top opcodes:", ", ".join(f"{op} {n}" for op, n in r["top_opcodes"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
