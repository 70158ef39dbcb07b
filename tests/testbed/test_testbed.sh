#!/bin/sh
# Test bed test: build a 3-node x 2-rail test bed, check every node reaches every other node on
# every rail and on the management network, that both NIC directions are shaped, and that
# teardown leaves no namespace, link or process behind. Skips (77) without root or iproute2.
set -u
here=$(cd "$(dirname "$0")" && pwd)
tb="$here/../../tests/testbed/testbed.sh"
[ -f "$tb" ] || tb="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null)/tests/testbed/testbed.sh"
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root"; exit 77; }
command -v ip >/dev/null && command -v ping >/dev/null || { echo "SKIP: needs iproute2 and ping"; exit 77; }
export RW_TESTBED_PREFIX=rwtt$$
fail=0
check() { if "$@" >/dev/null 2>&1; then :; else echo "FAIL: $*"; fail=1; fi; }

up_log=$(mktemp)
sh "$tb" up -n 3 -r 2 -m 50 2>"$up_log" || { echo "FAIL: up"; cat "$up_log"; sh "$tb" down; exit 1; }
# The small-packet priority band under each shaper, unless the bed said the kernel cannot.
band=1
grep -q "no htb qdisc or u32 filter" "$up_log" && { band=0; echo "note: kernel without htb/u32, no band"; }
rm -f "$up_log"
for s in 0 1 2; do
	for d in 0 1 2; do
		[ $s = $d ] && continue
		for r in 0 1; do check sh "$tb" exec $s ping -c1 -W2 -I rail$r 10.77.$r.$((d + 1)); done
		check sh "$tb" exec $s ping -c1 -W2 10.78.0.$((d + 1))
	done
	for r in 0 1; do
		check sh -c "ip netns exec $RW_TESTBED_PREFIX-n$s tc qdisc show dev rail$r | grep -q tbf"
		check sh -c "tc qdisc show dev $RW_TESTBED_PREFIX-${s}r$r | grep -q tbf"
		[ $band = 1 ] || continue
		check sh -c "ip netns exec $RW_TESTBED_PREFIX-n$s tc filter show dev rail$r parent 20: | grep -q 'flowid 20:1'"
		check sh -c "tc filter show dev $RW_TESTBED_PREFIX-${s}r$r parent 20: | grep -q 'flowid 20:1'"
	done
done
# A process left inside a node must not survive teardown.
ip netns exec "$RW_TESTBED_PREFIX-n1" sleep 300 &
sleeper=$!
sleep 0.2
sh "$tb" down
sleep 0.2
if kill -0 $sleeper 2>/dev/null; then echo "FAIL: process survived teardown"; kill -9 $sleeper; fail=1; fi
left=$(sh "$tb" status | wc -l)
[ "$left" = 0 ] || { echo "FAIL: $left namespaces/links left behind"; sh "$tb" status; fail=1; }
# A delay needs netem: either the bed has it on every NIC, or it refuses at once, naming netem,
# and leaves nothing behind.
if out=$(sh "$tb" up -n 2 -r 1 -d 5 2>&1); then
	check sh -c "ip netns exec $RW_TESTBED_PREFIX-n0 tc qdisc show dev rail0 | grep -q netem"
	sh "$tb" down
else
	echo "$out" | grep -q "netem" || { echo "FAIL: -d refused without naming netem: $out"; fail=1; }
fi
left=$(sh "$tb" status | wc -l)
[ "$left" = 0 ] || { echo "FAIL: $left namespaces/links left behind after -d"; sh "$tb" status; fail=1; }
[ $fail = 0 ] && echo "testbed: reachability, shaping, priority band, -d and teardown ok"
exit $fail
