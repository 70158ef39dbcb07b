#!/bin/sh
# The framework runs of docs/perf/frameworks.md, for the workplace's GPU machine (CUDA and
# PyTorch there, not this project's Debian libraries; tests/python/gpu_run.sh is the model):
#   sh tests/python/frameworks_gpu.sh prepare DIR [BUILD]   here: DIR gets the release binaries
#       and their libraries (gpu_run.sh prepare), this tree's python/ and tests/python/, the
#       deploy file, and the wheels in $WHEELS (megatron-core, torchtitan and what they import
#       that the image lacks)
#   sh DIR/src/tests/python/frameworks_gpu.sh run DIR [STAGES]   there, DIR carried: installs
#       the wheels into /tmp/site, starts two daemons (deploy/clusters/loopback-2x2-one-ip.json),
#       then 1: Megatron-Core (4 ranks) and its reference, 1l: 1 beside busy loops on all but
#       two cores (late daemons; the count from getconf: nproc follows OMP_NUM_THREADS), 2:
#       TorchTitan (4 ranks) and its reference, 2s: TorchTitan on a static Group
#       (RAILWAVE_STATIC=1: the sync-free dispatcher) and the reference, 3:
#       python/bench/frameworks_overhead.py on CPU and CUDA tensors. Logs go to $OUT (or /tmp);
#       RANK_TIMEOUT caps each rank (default 150 s).
#       DIR may also be gpu_run.sh's .gpucarry (prepared with the wheels), run from the
#       repository root: without DIR/src the sources are the working directory's
#       (tests/python/gpu_run.sh ready does so).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "${1:-}" in
prepare)
	d=$2; b=${3:-build}
	rm -rf "$d" && mkdir -p "$d/src/tests" "$d/src/deploy/clusters" "$d/whl"
	sh tests/python/gpu_run.sh prepare "$b" >/dev/null && mv .gpucarry/b .gpucarry/lib "$d/" &&
		rm -rf .gpucarry
	# the keygen the test clusters run (tests/integration/test_dataflow.py), like railwaved
	mkdir -p "$d/b/tools" && cp "$b/tools/railwave" "$d/b/tools/railwave.bin"
	for f in $(ldd "$b/tools/railwave" | awk '/=>/ {print $3}'); do
		case $f in */libc.so*|*/libm.so*) ;; *) cp -L "$f" "$d/lib/" ;; esac
	done
	printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH=$d/../../lib exec "$d/railwave.bin" "$@"\n' \
		> "$d/b/tools/railwave" && chmod +x "$d/b/tools/railwave"
	cp -r python "$d/src/python" && cp -r tests/python "$d/src/tests/python"
	mkdir -p "$d/src/tests/integration" && cp tests/integration/test_dataflow.py "$d/src/tests/integration/"
	cp deploy/clusters/loopback-2x2-one-ip.json "$d/src/deploy/clusters/"
	cp ${WHEELS:?set WHEELS to the folder of wheels}/*.whl "$d/whl/"
	find "$d" -name __pycache__ -prune -exec rm -rf {} +
	du -sh "$d"
	;;
run)
	D=$(readlink -f "$2"); O=${OUT:-/tmp}; stages=" ${3:-1 2 3} "; RT=${RANK_TIMEOUT:-150}
	S=$D/src; [ -d "$S" ] || S=$PWD
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
		"$D"/whl/*.whl || exit 1
	export PYTHONPATH=/tmp/site:$S/python:$S/python/shim-deep_ep
	export RAILWAVE_LIB=$D/b/lib/librailwave.so.1 LOCAL_WORLD_SIZE=2 WORLD_SIZE=4 PYTHONUNBUFFERED=1
	export RAILWAVE_MAX_TOKENS_PER_RANK=48 OMP_NUM_THREADS=2
	echo "== machine"; nvidia-smi -L; nproc
	python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__)'
	python3 -m pip list 2>/dev/null | grep -i -E "^(megatron|torchtitan|spmd|tyro) "
	cd "$S"
	mkdir -p /run/railwave
	"$D/b/railwaved" --config deploy/clusters/loopback-2x2-one-ip.json --node 0 > "$O/d0.log" 2>&1 & d0=$!
	"$D/b/railwaved" --config deploy/clusters/loopback-2x2-one-ip.json --node 1 > "$O/d1.log" 2>&1 & d1=$!
	sleep 2
	W=$(mktemp -d)
	ranks() {  # ranks NAME: 4 ranks of frameworks_gpu.py NAME, logs in $O/NAME.RANK.log
		pids=
		for r in 0 1 2 3; do
			s=$([ $r -lt 2 ] && echo a || echo b)
			RANK=$r LOCAL_RANK=$((r % 2)) RAILWAVE_SOCKET=/run/railwave/$s.sock \
				timeout "$RT" python3 tests/python/frameworks_gpu.py "$1" $r "$W" > "$O/$1.$r.log" 2>&1 &
			pids="$pids $!"
		done
		rc=0; for p in $pids; do wait "$p" || rc=1; done
		for r in 0 1 2 3; do grep -v "^\s*$" "$O/$1.$r.log" | tail -4; done
		return $rc
	}
	fail=0
	ref() {  # ref NAME: the one-process reference compares; rc 1 when it differs
		timeout 90 python3 tests/python/frameworks_gpu.py "$1" "$W" > "$O/$1.log" 2>&1; r=$?
		tail -12 "$O/$1.log"; echo "rc $r"; return $r
	}
	case $stages in *" 1 "*)
		echo "== 1: Megatron-Core MoELayer, flex dispatcher, deepep backend = railwave.deep_ep"
		{ ranks megatron && ref megatron-ref; } || fail=1 ;; esac
	case $stages in *" 1l "*)
		# The same beside busy loops on all but two cores: the daemons are late, the rank path's
		# kernels wait in the communication stream, and a caller's tensor that stream still
		# reads must not be handed back to the allocator (deep_ep's inputs recorded on it).
		echo "== 1l: Megatron-Core as in 1, beside $(( $(getconf _NPROCESSORS_ONLN) - 2 )) busy loops"
		hogs=; trap 'kill $hogs 2>/dev/null' EXIT  # a run cut short leaves no loop behind
		for _ in $(seq $(( $(getconf _NPROCESSORS_ONLN) - 2 ))); do python3 -c 'while True: pass' & hogs="$hogs $!"; done
		{ ranks megatron && ref megatron-ref; } || fail=1
		kill $hogs 2>/dev/null ;; esac
	case $stages in *" 2 "*)
		echo "== 2: TorchTitan MoE, railwave.torchtitan.railwave_dispatcher override"
		{ ranks titan && ref titan-ref; } || fail=1 ;; esac
	case $stages in *" 2s "*)
		echo "== 2s: TorchTitan MoE on a static Group (RAILWAVE_STATIC=1): the sync-free dispatcher"
		export RAILWAVE_STATIC=1
		{ ranks titan && ref titan-ref; } || fail=1
		unset RAILWAVE_STATIC ;; esac
	kill "$d0" "$d1"; wait "$d0"; wait "$d1"
	case $stages in *" 3 "*)
		echo "== 3: python/bench/frameworks_overhead.py (cpu, cuda)"
		for dev in cpu cuda; do
			RAILWAVE_MAX_TOKENS_PER_RANK= timeout 100 python3 python/bench/frameworks_overhead.py --build "$D/b" --device $dev \
				--iters ${ITERS:-300} 2>&1 | grep -v 'INFO\|WARN'
		done ;; esac
	exit $fail
	;;
*)
	echo "usage: sh tests/python/frameworks_gpu.sh prepare DIR [BUILD] | run DIR [STAGES]" >&2
	exit 2
	;;
esac
