#!/bin/sh
# The verbs transport for real: the rail conformance suite (tests/rdma/conformance.c, built as
# $b/bin/rail_conformance_verbs) in its two-machine mode between two Soft-RoCE guests
# (railvm.sh), on both rails at once:
#   rail 1: RDMA WRITE WITH IMMEDIATE, device configured by IP (librdmacm resolves it);
#   rail 0: RDMA WRITE + SEND forced (RW_VERBS_WRITE_SEND=1, the iWARP path), device configured
#           as "rxe0:1" (its IPv4 GID gives the address).
# Guest 0 runs the responders (--role=b), guest 1 the cmocka drivers (--role=a); the verbs unit
# test ($b/test/rdma_verbs) also runs in guest 1, where devices exist.
#   tests/rdma/vm/softroce.sh [BUILDDIR] [railvm options]     exit 0 pass, 77 skip, 1 fail
# The drivers' cmocka summary lines are printed unprefixed so that tests/run counts the cases.
set -u
here=$(cd "$(dirname "$0")" && pwd)
b=${1:-build}
[ $# -gt 0 ] && shift
conf=$b/bin/rail_conformance_verbs
unit=$b/test/rdma_verbs
[ -x "$conf" ] && [ -x "$unit" ] ||
	{ echo "softroce: SKIP: $conf or $unit not built (no rdma-core at configure time?)"; exit 77; }

# Where the suite can place its responder thread and killable child on a given address
# (--peer-local/--child-local), guest 0 then also runs it in one-machine mode on rxe1 (rxe
# loops same-device traffic back): the SIGKILL tests (peer and writer killed), which the
# two-guest phase skips. Only those (--tests=killed): everything else ran between the guests,
# and the whole suite again would add ~30 s of emulation (RW_VM_LOCAL_ALL=1 runs it all).
local_mode=
grep -q -- "--peer-local=" "$conf" && grep -q -- "--child-local=" "$conf" &&
	grep -q -- "--tests=" "$conf" && local_mode=1
local_tests=--tests=killed
[ -n "${RW_VM_LOCAL_ALL:-}" ] && local_tests=
responders='conf() { rail_conformance_verbs --role=b "$@"; }
conf --rail=1 --local=$RW_IP_1 --ctl=$RW_IP_0:7001 >/tmp/r1.log 2>&1 & p1=$!
RW_VERBS_WRITE_SEND=1 conf --rail=0 --local=rxe0:1 --ctl=$RW_IP_0:7000 >/tmp/r0.log 2>&1 & p0=$!
rc=0
wait $p1 || { echo "responder rail 1 failed"; rc=1; }
wait $p0 || { echo "responder rail 0 failed"; rc=1; }
for r in 1 0; do sed "s/^/rail $r: /" /tmp/r$r.log; done
if [ -n "'"$local_mode"'" ]; then
	rail_conformance_verbs --rail=1 --local=$RW_IP_1 --peer-local=$RW_IP_1 \
		--child-local=$RW_IP_1 '"$local_tests"' >/tmp/l.log 2>&1 || rc=1
	sed "s/^/local: /" /tmp/l.log
fi
exit $rc'
# The drivers log at debug level (RW_RAIL_DEBUG) so that the write mode each connection used
# is on record; only the mode lines and errors are printed, and each rail must show its mode.
drivers='conf() { RW_RAIL_DEBUG=1 rail_conformance_verbs --role=a "$@"; }
rdma_verbs >/tmp/u.log 2>&1; urc=$?
conf --rail=1 --local=$RW_IP_1 --peer=$RW_PEER_IP_0:7001 >/tmp/d1.log 2>&1 & p1=$!
RW_VERBS_WRITE_SEND=1 conf --rail=0 --local=rxe0:1 --peer=$RW_PEER_IP_0:7000 >/tmp/d0.log 2>&1 & p0=$!
rc=0
wait $p1 || rc=1
wait $p0 || rc=1
sed "s/^/unit: /" /tmp/u.log
[ $urc = 0 ] || rc=1
for r in 1 0; do
	grep -v " DEBUG \| INFO " /tmp/d$r.log | sed "s/^/rail $r: /"
	grep -m 1 " INFO verbs: rail $r: rxe" /tmp/d$r.log | sed "s/^/rail $r: /"
	grep -m 1 " INFO verbs: rail $r: connected to" /tmp/d$r.log | sed "s/^/rail $r: /"
done
n1=$(grep -c "connected to .*(RDMA WRITE WITH IMM" /tmp/d1.log)
n0=$(grep -c "connected to .*(RDMA WRITE + SEND" /tmp/d0.log)
b1=$(grep -c "(RDMA WRITE + SEND" /tmp/d1.log)
b0=$(grep -c "(RDMA WRITE WITH IMM" /tmp/d0.log)
echo "write modes: rail 1 $n1 connections with immediate ($b1 without), rail 0 $n0 with WRITE + SEND ($b0 with immediate)"
[ "$n1" -gt 0 ] && [ "$n0" -gt 0 ] && [ "$b1" = 0 ] && [ "$b0" = 0 ] || { echo "write modes not as configured"; rc=1; }
exit $rc'

out=$(mktemp) || exit 1
trap 'rm -f "$out"' EXIT
sh "$here/railvm.sh" -t 540 -b "$conf" -b "$unit" -0 "$responders" -1 "$drivers" "$@" >"$out" 2>&1
rc=$?
cat "$out"
[ $rc = 77 ] && exit 77
# Re-emit the drivers' cmocka summaries for tests/run's counting.
sed -n 's/^\[g[01]\] \(unit\|rail [01]\|local\): \(\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test.*\)$/\2/p' "$out"
exit $rc
