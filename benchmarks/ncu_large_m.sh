#!/usr/bin/env bash
# Nsight Compute reports of the table's NVFP4 GEMM and of cuBLAS bf16 at the same points (a probe).
#   OUT=dir bash benchmarks/ncu_large_m.sh "7B:gate_up:1024 7B:gate_up:256"
# Writes OUT/ncu_<shape>_<m>_{qerl,cublas}.txt: speed of light, tensor-pipe use, warp stalls (each reason's
# warps per issued instruction), launch stats.
set -u
points=${1:-"7B:gate_up:1024"}
variant=${2:-}  # FwdConfig fields over the table's tile (ncu_small_m.py --variant), e.g. halves=1
out=${OUT:-.}
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
for p in $points; do
  IFS=: read -r model layer m <<<"$p"
  tag="${model}_${layer}_${m}"
  ncu --clock-control none $sections -k regex:nvfp4_fwd --launch-skip 2 --launch-count 1 \
    python benchmarks/ncu_small_m.py --shape "$model:$layer" --m "$m" --variant "$variant" > "$out/ncu_${tag}_qerl${variant:+_${variant//[=,]/-}}.txt" 2>&1
  [ -n "$variant" ] && continue
  ncu --clock-control none $sections -k regex:'nvjet|gemm|xmma|cutlass' --launch-skip 2 --launch-count 1 \
    python benchmarks/ncu_small_m.py --shape "$model:$layer" --m "$m" --cublas > "$out/ncu_${tag}_cublas.txt" 2>&1
done
