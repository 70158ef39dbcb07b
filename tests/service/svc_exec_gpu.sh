#!/bin/sh
# svc_exec's count-on-the-GPU cases (test_gpu_*: the CUDA mover listed first, as main.c lists it)
# on the kernel stand-in tests/integration/libfakecuda_kern.so, whose kernels run on the CPU:
# once with stream work done at once, once with every copy, kernel and mark late and in order on
# a worker thread (RW_FAKE_CUDA_LAG_MS). A build without embedded kernels skips them.
# Run by tests/run as $b/test/svc_exec_gpu.
b=$(dirname "$(dirname "$(readlink -f "$0")")")
kern="$b/tests/integration/libfakecuda_kern.so"
[ -f "$kern" ] || { echo "skip: no kernel stand-in ($kern)"; exit 77; }
rc=0
for lag in 0 2; do
	RW_CUDA_DRIVER="$kern" RW_FAKE_CUDA_LAG_MS=$lag RW_EXEC_ONLY="test_gpu_*" "$b/test/svc_exec" || rc=1
done
exit $rc
