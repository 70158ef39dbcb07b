#!/bin/bash
# Device run for the CUDA mover (docs/perf/cuda-mover.md). Output: $OUT/log.
C=$PWD/.gpucarry/cm
export LD_LIBRARY_PATH=$C/lib PYTHONUNBUFFERED=1
B=$C/b
exec > >(tee $OUT/log) 2>&1
echo "== $(date -u '+%F %T UTC') uptime $(cut -d' ' -f1 /proc/uptime) s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
uname -r; grep PRETTY /etc/os-release; nproc
echo "== 1: GPU test build/test/cuda_mover"
timeout 240 python3 $B/test/cuda_mover; echo "rc=$?"
for f in /tmp/rwcm.*/d0.log; do :; done
echo "== 2: mutations (broken kernels must be caught)"
for v in copy acc; do timeout 60 python3 $C/mut/mut.py $B $C/mut/railwaved.$v $v 2>&1 | tail -1; done
echo "== 3: benchmark build/bench/cuda_mover"
timeout 200 python3 $B/bench/cuda_mover --hidden 7168 --tokens 256,1024 --layers 4 --steps 2; echo "rc=$?"
echo "== end $(date -u '+%T')"
