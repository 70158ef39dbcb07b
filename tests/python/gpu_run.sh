#!/bin/sh
# The GPU runs of the railwave package (docs/python.md "Tests"), for a machine that has CUDA and
# PyTorch but not this project's Debian libraries (the workplace's GPU image):
#   sh tests/python/gpu_run.sh prepare [BUILD]   here, after ./configure && ninja: writes the
#       folder $GPUCARRY (default .gpucarry/, in .gitignore, so the device tool can carry it)
#       (the release binaries, librailwave.so.1, the shared libraries
#       railwaved and ipc_bench need, wrappers that point LD_LIBRARY_PATH at them for those two
#       binaries only, so python3 keeps its own libraries)
#   sh tests/python/gpu_run.sh ready             there, from the repository root, with $GPUCARRY
#       carried (prepared with the wheels: WHEELS, default .whl/, git-ignored): the readiness run, one
#       call, < 240 s: the package on CUDA eager, on the rank path's static mode with CUDA
#       graphs of the forward and of forward + backward replayed 100 times, a bad argument on
#       one static rank, then Megatron-Core and TorchTitan (eager and static) with the real
#       wheels (tests/python/frameworks_gpu.sh run); one verdict line per stage with its wall
#       time, then "ready: N of M stages passed"
#   sh tests/python/gpu_run.sh run [STAGES]      there, from the repository root, with $GPUCARRY
#       carried: the CUDA scenario of test_moe.py, examples/moe_train.py on CUDA against its
#       one-process reference, and python/bench/overhead.py (the first two sizes, against the
#       package of main as well: $GPUCARRY/before); stage 4, the rank path (docs/python.md "The
#       rank path"): test_moe.py's rank, rankstatic (CUDA graphs of the forward and of forward +
#       backward) and rankkill scenarios, and
#       overhead.py --rank-path (host time per call). Outputs go to $OUT (or /tmp). STAGES:
#       which of the four (default "1 2 3 4").
# NVLink multicast stays off in every process (the GPU machines' rule): NCCL_NVLS_ENABLE=0 etc.
set -u
C=${GPUCARRY:-.gpucarry}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "${1:-}" in
prepare)
	b=${2:-build}
	rm -rf "$C" && mkdir -p $C/b/bench $C/b/lib $C/lib
	cp "$b/railwaved" $C/b/railwaved.bin
	cp "$b/bench/ipc_bench" $C/b/bench/ipc_bench.bin
	cp "$b/bench/pair_bench" $C/b/bench/pair_bench
	cp -L "$b/lib/librailwave.so.1" $C/b/lib/librailwave.so.1
	mkdir -p $C/b/tests/lib && cp "$b/tests/lib/cluster.py" $C/b/tests/lib/   # the daemons' harness
	mkdir -p $C/b/tools && cp "$b/tools/railwave" $C/b/tools/railwave.bin   # its keygen
	W=${WHEELS:-.whl}   # megatron-core, torchtitan and what they import (ready; docs/python.md)
	if [ -d "$W" ]; then mkdir -p $C/whl && cp "$W"/*.whl $C/whl/; fi
	mkdir -p $C/before && git archive "${BEFORE:-main}" python/railwave | tar -x -C $C/before
	for f in $(ldd "$b/railwaved" "$b/bench/ipc_bench" "$b/tools/railwave" | awk '/=>/ {print $3}' | sort -u); do
		case $f in */libc.so*|*/libm.so*) ;; *) cp -L "$f" $C/lib/ ;; esac
	done
	printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH=$d/../lib exec "$d/railwaved.bin" "$@"\n' \
		> $C/b/railwaved
	printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH=$d/../../lib exec "$d/ipc_bench.bin" "$@"\n' \
		> $C/b/bench/ipc_bench
	printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH=$d/../../lib exec "$d/railwave.bin" "$@"\n' \
		> $C/b/tools/railwave
	chmod +x $C/b/railwaved $C/b/bench/ipc_bench $C/b/tools/railwave
	du -sh "$C"
	;;
ready)
	# Each stage: its command under a timeout (the caps add up to 235 s), then one line
	# "STAGE pass|FAIL (rc) in S s: what"; the logs in $OUT (or /tmp).
	B=$PWD/$C/b
	O=${OUT:-/tmp}
	t00=$(date +%s)
	nvidia-smi -L | head -1
	python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
	passed=0; total=0
	stage() {  # stage NAME CAP WHAT CMD...: run CMD, print the verdict line
		name=$1 cap=$2 what=$3; shift 3
		t0=$(date +%s)
		timeout "$cap" "$@" > "$O/ready_$name.txt" 2>&1; rc=$?
		t=$(( $(date +%s) - t0 )); total=$((total + 1))
		if [ $rc -ne 0 ]; then v="FAIL (rc $rc)"
		elif grep -q '^skip' "$O/ready_$name.txt"; then v="SKIPPED ($(grep -m1 '^skip' "$O/ready_$name.txt" | cut -c1-120))"
		else v=pass; passed=$((passed + 1)); fi
		echo "$name $v in ${t} s (cap $cap s): $what"
		[ $rc -eq 0 ] || grep -v '^  d[0-9]|' "$O/ready_$name.txt" | grep -m8 'FAIL\|Error\|error:' | cut -c1-300
	}
	export RW_TEST_SEED=${SEED:-11}
	stage eager 45 "RW_PY_ONLY=cuda test_moe.py: CUDA tensors on the daemon's mover, every path exact" \
		env RW_PY_ONLY=cuda python3 tests/python/test_moe.py "$B"
	stage static 80 "RW_PY_ONLY=rankstatic,rankstaticbad RW_PY_RANK_DEVICE=cuda: static steps, fwd+bwd, overflow, SMs, CUDA graphs of fwd and of fwd+bwd replayed 100 times exact, a bad argument on one rank" \
		env RW_PY_ONLY=rankstatic,rankstaticbad RW_PY_RANK_DEVICE=cuda python3 tests/python/test_moe.py "$B"
	grep -h '^ok.*graph' "$O/ready_static.txt" | cut -c1-200
	stage frameworks 110 "frameworks_gpu.sh run: Megatron-Core, TorchTitan eager and static, with the wheels, against one-process references" \
		env RANK_TIMEOUT=40 sh tests/python/frameworks_gpu.sh run "$C" "1 2 2s"
	grep -h '^== \|EQUAL\|DIFFER' "$O/ready_frameworks.txt" | cut -c1-200
	echo "ready: $passed of $total stages passed in $(( $(date +%s) - t00 )) s"
	[ $passed -eq $total ]
	;;
run)
	B=$PWD/$C/b
	O=${OUT:-/tmp}
	echo "== machine"; nvidia-smi -L; uname -r; nproc
	python3 -c 'import torch, numpy, sys; print(sys.version.split()[0], torch.__version__, numpy.__version__, torch.cuda.is_available())'
	stages=" ${2:-1 2 3 4} "
	case $stages in *" 1 "*) ;; *) false ;; esac &&
	{
	echo "== 1: RW_PY_ONLY=cuda python3 tests/python/test_moe.py $C/b"
	RW_PY_ONLY=cuda RW_TEST_SEED=${SEED:-11} timeout 300 python3 tests/python/test_moe.py "$B" > "$O/test_moe_cuda.txt" 2>&1
	echo "rc $?"; grep -v '^  d[0-9]|' "$O/test_moe_cuda.txt" | tail -30
	}
	case $stages in *" 2 "*) ;; *) false ;; esac &&
	{
	echo "== 2: examples/moe_train.py --device cuda on deploy/clusters/loopback-2x2-one-ip.json"
	mkdir -p /run/railwave
	"$B/railwaved" --config deploy/clusters/loopback-2x2-one-ip.json --node 0 > "$O/train_d0.log" 2>&1 & d0=$!
	"$B/railwaved" --config deploy/clusters/loopback-2x2-one-ip.json --node 1 > "$O/train_d1.log" 2>&1 & d1=$!
	sleep 2
	pids=
	for r in 0 1 2 3; do
		s=$([ $r -lt 2 ] && echo a || echo b)
		RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
		MASTER_PORT=29511 RAILWAVE_SOCKET=/run/railwave/$s.sock PYTHONPATH=python \
		RAILWAVE_LIB=$B/lib/librailwave.so.1 timeout 200 python3 examples/moe_train.py \
			--device cuda --steps 5 > "$O/train_r$r.log" 2>&1 &
		pids="$pids $!"
	done
	for p in $pids; do wait "$p"; echo "rank exit $?"; done
	echo "-- railwave (4 ranks, CUDA):"; tail -8 "$O/train_r0.log"
	echo "-- reference (one process, CUDA):"
	PYTHONPATH=python RAILWAVE_LIB=$B/lib/librailwave.so.1 python3 examples/moe_train.py \
		--reference --world 4 --device cuda --steps 5
	kill "$d0" "$d1"; wait "$d0"; wait "$d1"
	}
	case $stages in *" 3 "*) ;; *) false ;; esac &&
	{
	echo "== 3: python/bench/overhead.py --build $C/b"
	timeout 240 python3 python/bench/overhead.py --build "$B" --iters 2000 --sizes 2 \
		--before $C/before/python 2>&1 | grep -v 'INFO\|WARN'
	}
	case $stages in *" 4 "*) ;; *) exit 0 ;; esac
	echo "== 4: RW_PY_ONLY=rank,rankstatic,rankstaticbad,rankkill RW_PY_RANK_DEVICE=cuda python3 tests/python/test_moe.py $C/b"
	RW_PY_ONLY=rank,rankstatic,rankstaticbad,rankkill RW_PY_RANK_DEVICE=cuda RW_TEST_SEED=${SEED:-11} timeout 480 \
		python3 tests/python/test_moe.py "$B" > "$O/test_moe_rank.txt" 2>&1
	echo "rc $?"; grep -v '^  d[0-9]|' "$O/test_moe_rank.txt" | tail -30
	grep 'WARN\|ERR' "$O/test_moe_rank.txt" | head -20
	echo "== 4b: python/bench/overhead.py --rank-path --build $C/b"
	timeout 240 python3 python/bench/overhead.py --rank-path --build "$B" --iters 2000 \
		--sizes 2 2>&1 | grep -v 'INFO\|WARN'
	;;
*)
	echo "usage: sh tests/python/gpu_run.sh prepare [BUILD] | ready | run [STAGES]" >&2
	exit 2
	;;
esac
