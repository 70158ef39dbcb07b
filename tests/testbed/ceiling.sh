#!/bin/sh
# Transport ceiling of the rail test bed (docs/perf/testbed.md): plain TCP (iperf3) moving a
# perfectly balanced all-to-all - every NIC sends BYTES to each of the other N-1 nodes on its
# own rail, all flows at once - and the wall time until the last flow ends, against the lower
# bound (N-1) * BYTES / rate. This is what any transport can reach on this machine right now.
#   ceiling.sh [-n NODES] [-r RAILS] [-m MBIT] [-b BYTES_PER_FLOW]   (root; builds its own bed)
set -eu
nodes=4 rails=4 mbit=50 bytes=1466000
while getopts n:r:m:b: o; do
	case $o in n) nodes=$OPTARG ;; r) rails=$OPTARG ;; m) mbit=$OPTARG ;; b) bytes=$OPTARG ;; *) exit 2 ;; esac
done
here=$(cd "$(dirname "$0")" && pwd)
export RW_TESTBED_PREFIX=rwc$$ # short: link names must fit 15 bytes
tb="sh $here/testbed.sh"
trap '$tb down' EXIT INT TERM
$tb up -n "$nodes" -r "$rails" -m "$mbit" >/dev/null
port() { echo $((6000 + ($1 * 64 + $2) * 16 + $3)); } # dst, src, rail
for d in $(seq 0 $((nodes - 1))); do for s in $(seq 0 $((nodes - 1))); do [ $s = $d ] && continue
	for r in $(seq 0 $((rails - 1))); do
		$tb exec $d iperf3 -s -1 -D -B 10.77.$r.$((d + 1)) -p "$(port $d $s $r)"
	done; done; done
sleep 1
t0=$(date +%s.%N)
pids=
for s in $(seq 0 $((nodes - 1))); do for d in $(seq 0 $((nodes - 1))); do [ $s = $d ] && continue
	for r in $(seq 0 $((rails - 1))); do
		$tb exec $s iperf3 -c 10.77.$r.$((d + 1)) -B 10.77.$r.$((s + 1)) -p "$(port $d $s $r)" -n "$bytes" >/dev/null &
		pids="$pids $!"
	done; done; done
for p in $pids; do wait $p; done
t1=$(date +%s.%N)
awk -v t0="$t0" -v t1="$t1" -v b="$bytes" -v n="$nodes" -v r="$rails" -v m="$mbit" 'BEGIN {
	lb = (n - 1) * b * 8 / (m * 1e6); t = t1 - t0;
	printf "ceiling: %d flows of %d bytes: %.3f s, lower bound %.3f s, ratio %.2f\n", n * (n - 1) * r, b, t, lb, t / lb }'
