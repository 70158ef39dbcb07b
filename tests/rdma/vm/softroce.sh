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

responders='conf() { rail_conformance_verbs --role=b "$@"; }
conf --rail=1 --local=$RW_IP_1 --ctl=$RW_IP_0:7001 >/tmp/r1.log 2>&1 & p1=$!
RW_VERBS_WRITE_SEND=1 conf --rail=0 --local=rxe0:1 --ctl=$RW_IP_0:7000 >/tmp/r0.log 2>&1 & p0=$!
rc=0
wait $p1 || { echo "responder rail 1 failed"; rc=1; }
wait $p0 || { echo "responder rail 0 failed"; rc=1; }
for r in 1 0; do sed "s/^/rail $r: /" /tmp/r$r.log; done
exit $rc'
drivers='conf() { rail_conformance_verbs --role=a "$@"; }
rdma_verbs >/tmp/u.log 2>&1; urc=$?
conf --rail=1 --local=$RW_IP_1 --peer=$RW_PEER_IP_0:7001 >/tmp/d1.log 2>&1 & p1=$!
RW_VERBS_WRITE_SEND=1 conf --rail=0 --local=rxe0:1 --peer=$RW_PEER_IP_0:7000 >/tmp/d0.log 2>&1 & p0=$!
rc=0
wait $p1 || rc=1
wait $p0 || rc=1
sed "s/^/unit: /" /tmp/u.log
[ $urc = 0 ] || rc=1
for r in 1 0; do sed "s/^/rail $r: /" /tmp/d$r.log; done
exit $rc'

out=$(mktemp) || exit 1
trap 'rm -f "$out"' EXIT
sh "$here/railvm.sh" -t 540 -b "$conf" -b "$unit" -0 "$responders" -1 "$drivers" "$@" >"$out" 2>&1
rc=$?
cat "$out"
[ $rc = 77 ] && exit 77
# Re-emit the drivers' cmocka summaries (guest 1) for tests/run's counting.
sed -n 's/^\[g1\] \(unit\|rail [01]\): \(\[  \(PASSED  \|FAILED  \|SKIPPED \)\] [0-9]* test.*\)$/\2/p' "$out"
exit $rc
