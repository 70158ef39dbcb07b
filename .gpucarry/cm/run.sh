#!/bin/bash
# Device run for the CUDA mover (docs/perf/cuda-mover.md). Output: $OUT/log.
C=$PWD/.gpucarry/cm
export LD_LIBRARY_PATH=$C/lib PYTHONUNBUFFERED=1
B=$C/b
exec > >(tee $OUT/log) 2>&1
echo "== $(date -u '+%F %T UTC') uptime $(cut -d' ' -f1 /proc/uptime) s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
echo "== 1: diagnosis: RAILWAVE_CUDA_MOVER=check, seed 750654370 (failed in call 1) and 777"
timeout 100 python3 $C/diag.py $B 750654370
timeout 60 python3 $C/diag.py $B 777
echo "== 2: GPU test build/test/cuda_mover"
RW_TEST_SEED=750654370 timeout 150 python3 $B/test/cuda_mover 2>&1 | grep -v "^  d[01]|" | head -40; echo "rc=${PIPESTATUS[0]}"
echo "== 3: benchmark build/bench/cuda_mover"
timeout 180 python3 $B/bench/cuda_mover --hidden 7168 --tokens 256,1024 --layers 4 --steps 2 2>&1 | grep -v "^  d[01]|" | tail -40; echo "rc=${PIPESTATUS[0]}"
echo "== end $(date -u '+%T')"
