#!/bin/sh
# Build cuda/ and its GPU tests with plain gcc + nvcc (no configure, ninja, libev or cmocka
# needed) and run them: the device-machine recipe behind docs/perf/runs/cuda-gpu.md.
#   sh tests/cuda/gpu_run.sh [OUTDIR]      (default /tmp/rw-gpu; run from anywhere)
# Exits non-zero if a test fails. Set RW_GPU_SANITIZE=1 to also run the tests under
# compute-sanitizer memcheck.
set -eu
cd "$(dirname "$0")/../.."
out=${1:-/tmp/rw-gpu}
mkdir -p "$out/cuda"
cuda_inc=${CUDA_INC:-/usr/local/cuda/include}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
cc=${CC:-gcc}

echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
"$nvcc" --version | tail -n 2
$cc --version | head -n 1

cat > "$out/config.h" <<EOC
#ifndef RW_CONFIG_H
#define RW_CONFIG_H
#define RW_HAVE_VERBS 0
#define RW_HAVE_MHD 0
#define RW_HAVE_NVCC 1
#define RW_HAVE_CUDA_H 1
#define RW_SANITIZE 0
#endif
EOC
cflags="-std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wshadow -Wmissing-prototypes -Wstrict-prototypes -Werror -I. -I$out -isystem $cuda_inc"

echo "== build"
"$nvcc" -fatbin -arch=sm_90 -gencode 'arch=compute_90,code=[sm_90,compute_90]' -O3 \
	-o "$out/cuda/kernels.fatbin" cuda/kernels.cu
"$nvcc" -cubin -arch=sm_90 -O3 -Xptxas -v -o "$out/cuda/kernels.cubin" cuda/kernels.cu 2>&1 |
	grep -E 'Compiling entry|registers|stack frame' | sed 's/^/  /' || true
sh scripts/bin2c.sh rw_cuda_kernels_fatbin "$out/cuda/kernels.fatbin" "$out/cuda/kernels_image.c"
objs=
for f in common/status.c common/log.c cuda/driver.c cuda/ipc.c cuda/stream.c cuda/kernels.c \
	cuda/event.c cuda/words.c cuda/peer.c cuda/vmm.c cuda/pull.c cuda/absent.c sched/counts.c sched/topo.c \
	"$out/cuda/kernels_image.c"; do
	o="$out/cuda/$(basename "$f" .c).o"
	$cc $cflags -c "$f" -o "$o"
	objs="$objs $o"
done
printf '#include <stdarg.h>\n#include <stddef.h>\n#include <stdint.h>\n#include <setjmp.h>\n#include <cmocka.h>\nint main(void){return 0;}\n' > "$out/t.c"
if [ "${RW_GPU_MINI:-0}" != 1 ] && $cc "$out/t.c" -o "$out/t" -lcmocka >/dev/null 2>&1; then tflags=-lcmocka; else tflags=-DRW_MINI_CMOCKA; fi
echo "test harness: $tflags"
# test_cuda.c and the contracts it runs (the words', GPU memory lent by fd), one unit: the mini
# harness keeps its state in statics.
printf '#include "tests/cuda/test_cuda.c"\n#include "tests/cuda/words_contract.c"\n#include "tests/cuda/vmm_contract.c"\n' \
	> "$out/test_cuda_all.c"
# shellcheck disable=SC2086
$cc $cflags $tflags -o "$out/test_cuda" "$out/test_cuda_all.c" $objs -ldl -lpthread -lm \
	$( [ "$tflags" = -lcmocka ] && echo -lcmocka )
# shellcheck disable=SC2086
$cc $cflags -o "$out/bench_pack" tests/cuda/bench_pack.c $objs -ldl -lpthread

echo "== tests"
rc=0
"$out/test_cuda" || rc=1
if [ "${RW_GPU_SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null 2>&1; then
	echo "== compute-sanitizer memcheck"
	timeout 300 compute-sanitizer --tool memcheck --target-processes all "$out/test_cuda" 2>&1 |
		grep -E 'ERROR SUMMARY|PASSED|FAILED|SKIPPED|Invalid|Error' || rc=1
fi
echo "== bench"
"$out/bench_pack" || { r=$?; [ $r = 77 ] || rc=1; }
echo "== gpu_run.sh exit $rc"
exit $rc
