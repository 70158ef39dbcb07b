#!/bin/sh
# CI run of `railwave demo` on the rail test bed (docs/demo.md "Tests"): 3 nodes x 2 rails x 2
# ranks per node, small payloads, every forced path and the selector across network namespaces.
# The rank programs verify every dispatched row and combined sum, the demo checks that every
# daemon's per-NIC byte counters equal the plan; then nothing may be left behind: no namespace,
# no link, no process started by the run. Skips (77) without root, iproute2 or python3.
set -u
here=$(cd "$(dirname "$0")" && pwd) # $b/test
b=$(dirname "$here")
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root"; exit 77; }
for c in ip tc python3; do
	command -v $c >/dev/null || { echo "SKIP: needs $c"; exit 77; }
done
prefix=rwci$$
work=$(mktemp -d /tmp/rwci.XXXXXX)
log=$work.log
fail=0
"$b/tools/railwave" demo --short --nodes 3 --rails 2 --gpus 2 --prefix "$prefix" \
	--require-testbed --workdir "$work" >"$log" 2>&1
rc=$?
if [ $rc != 0 ]; then
	echo "FAIL: demo exited $rc"; tail -n 40 "$log"; fail=1
fi
for p in native rail-only perm-only joint "selector (auto"; do
	n=$(grep -c "^== $p" "$log")
	[ "$n" = 1 ] || { echo "FAIL: no result for $p"; fail=1; }
done
v=$(grep -c "verified: 6 ranks x 4 pairs, .* exact; daemons' per-NIC tx bytes match the plan" "$log")
[ "$v" = 5 ] || { echo "FAIL: $v of 5 runs verified with matching counters"; grep "verified" "$log"; fail=1; }
# Teardown: no namespace, link or process of this run may survive.
left=$(ip netns list | grep -c "^$prefix-")
[ "$left" = 0 ] || { echo "FAIL: $left namespaces left"; fail=1; }
links=$(ip -o link show | grep -c ": $prefix-")
[ "$links" = 0 ] || { echo "FAIL: $links links left"; fail=1; }
# (The bracket keeps this grep from matching its own command line.)
last=${work#"${work%?}"}
procs=$(grep -l -a "${work%?}[$last]" /proc/[0-9]*/cmdline 2>/dev/null | wc -l)
[ "$procs" = 0 ] || { echo "FAIL: $procs processes of the run still alive"; fail=1; }
[ $fail = 0 ] && { grep "^railwave demo\|^network\|teardown" "$log"; echo "demo on the test bed: all paths verified, nothing left behind"; }
rm -rf "$work" "$log"
exit $fail
