#!/bin/sh
# Transport ceiling of the rail test bed (docs/perf/testbed.md): plain TCP moving a perfectly
# balanced all-to-all - every NIC sends BYTES to each of the other N-1 nodes on its own rail, all
# flows at once, over connections opened beforehand (tests/testbed/tcp_alltoall.py, one process
# per node) - timed until the last flow of the phase ends, against the lower bound
# (N-1) * BYTES / rate, REPS times. This is what concurrent TCP flows reach on this bed; it is
# the reference for RailWave's all-at-once paths (Native, Rail-only).
#   ceiling.sh [-n NODES] [-r RAILS] [-m MBIT] [-b BYTES_PER_FLOW] [-k REPS]   (root; own bed)
set -eu
nodes=4 rails=4 mbit=50 bytes=1466000 reps=5
while getopts n:r:m:b:k: o; do
	case $o in n) nodes=$OPTARG ;; r) rails=$OPTARG ;; m) mbit=$OPTARG ;; b) bytes=$OPTARG ;;
	k) reps=$OPTARG ;; *) exit 2 ;; esac
done
here=$(cd "$(dirname "$0")" && pwd)
export RW_TESTBED_PREFIX=rwc$$ # short: link names must fit 15 bytes
tb="sh $here/testbed.sh"
out=$(mktemp -d /tmp/rwceiling.XXXXXX)
trap '$tb down; rm -rf "$out"' EXIT INT TERM
$tb up -n "$nodes" -r "$rails" -m "$mbit" >/dev/null
t0=$(python3 -c 'import time; print(time.monotonic())')
pids=
for n in $(seq 0 $((nodes - 1))); do
	$tb exec "$n" python3 "$here/tcp_alltoall.py" "$n" "$nodes" "$rails" "$bytes" "$reps" "$t0" \
		>"$out/$n" &
	pids="$pids $!"
done
for p in $pids; do wait "$p"; done
# Per repetition: the slowest node's last arrival.
paste "$out"/* | awk -v b="$bytes" -v n="$nodes" -v r="$rails" -v m="$mbit" '
	{ t = 0; for (i = 2; i <= NF; i += 2) if ($i > t) t = $i; ts[NR] = t; k = NR }
	END {
		lb = (n - 1) * b * 8 / (m * 1e6)
		for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (ts[j] < ts[i]) { x = ts[i]; ts[i] = ts[j]; ts[j] = x }
		med = k % 2 ? ts[(k + 1) / 2] : (ts[k / 2] + ts[k / 2 + 1]) / 2
		printf "ceiling: %d flows of %d bytes, %d repetitions: median %.3f s (min %.3f, max %.3f), lower bound %.3f s, ratio %.2f (min %.2f)\n",
			n * (n - 1) * r, b, k, med, ts[1], ts[k], lb, med / lb, ts[1] / lb }'
