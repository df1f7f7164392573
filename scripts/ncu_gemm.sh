#!/usr/bin/env bash
# Nsight Compute profile of fp8jax's FP8 GEMM kernel and cuBLAS's blockwise FP8 GEMM on one Llama shape (M = 8192)
# (what limits the kernel: pipe utilization, stalls, registers, memory). Needs ncu with hardware counters (the
# H200 machines' Firecracker runtime has them). Clocks are left alone (--clock-control none).
#   PYTHONPATH=. bash scripts/ncu_gemm.sh [SHAPE=o] [OUTDIR=$OUT or .] [M=8192]
# Writes ncu_<shape>_{ours,cublas}.ncu-rep and ncu_<shape>_{ours,cublas}.txt (full section set, one launch each
# after a warm-up launch) and prints the headline metrics of both.
set -euo pipefail
shape="${1:-o}"
out="${2:-${OUT:-.}}"
m="${3:-8192}"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)"
if [[ -z "$NCU" ]]; then
  echo "ncu_gemm.sh: Nsight Compute (ncu) not found on PATH or under /opt/nvidia/nsight-compute" >&2
  exit 2
fi
# JAX would preallocate 75% of the GPU, and ncu's kernel replay saves and restores all allocated memory per pass.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
target=("${PYTHON:-python3}" scripts/bench_gemm.py --ncu-target "$shape" --ms "$m")
# Ours is named fp8jax_fp8_gemm (kernel_name in pallas_kernels/fp8_gemm_mgpu.py); cuBLAS's FP8 GEMMs on sm_90 are
# nvjet_sm90_* kernels (torch 2.11 / CUDA 12.x).
for who in ours cublas; do
  if [[ $who == ours ]]; then k='regex:fp8jax_fp8_gemm'; else k='regex:nvjet|sm90_xmma|cutlass'; fi
  "$NCU" --clock-control none --set full -k "$k" --launch-skip 1 --launch-count 1 -f -o "$out/ncu_${shape}_$who" \
    "${target[@]}" > "$out/ncu_${shape}_${who}_run.txt" 2>&1 || { tail -5 "$out/ncu_${shape}_${who}_run.txt"; exit 1; }
  "$NCU" -i "$out/ncu_${shape}_$who.ncu-rep" --page details > "$out/ncu_${shape}_$who.txt"
  "$NCU" -i "$out/ncu_${shape}_$who.ncu-rep" --page raw > "$out/ncu_${shape}_${who}_raw.txt"
done
for who in ours cublas; do
  echo "=== $who"
  grep -E "^  [^ ].*\(|^    (Duration|Registers Per Thread|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit Rate|Issue Slots Busy|Issued Ipc Active|Achieved Occupancy|Dynamic Shared Memory Per Block|No Eligible|One or More Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Warp Cycles Per Issued Instruction|Block Size|Grid Size|Cluster Size) " \
    "$out/ncu_${shape}_$who.txt" | head -40
  grep -E "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_(active|elapsed) |sm__inst_executed_pipe_tensor_op_gmma.sum |smsp__average_warp" "$out/ncu_${shape}_${who}_raw.txt" | head -12
done
