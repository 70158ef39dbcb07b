#!/bin/sh
# `railwave stats` against two real railwaved processes on loopback: the default command, a
# sub-command, the peer view once both daemons see each other, an unknown command (error line,
# exit 1) and a socket nobody listens on (clear message, exit 1).
set -u
b=$(cd "$(dirname "$0")/.." && pwd)       # the build folder: build/ or build-asan/
tool="$b/tools/railwave"; daemon="$b/railwaved"
[ -x "$tool" ] && [ -x "$daemon" ] || { echo "SKIP: build railwave and railwaved first"; exit 77; }
dir=$(mktemp -d /tmp/rwstats.XXXXXX)
cleanup() { kill $pids 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
fail=0
check() { if ! "$@"; then echo "FAIL: $*"; fail=1; fi; }

# Free ports, then a two-node cluster on 127.0.0.1.
set -- $(python3 -c 'import socket
ss=[socket.socket() for _ in range(6)]
[s.bind(("127.0.0.1",0)) for s in ss]
print(" ".join(str(s.getsockname()[1]) for s in ss))')
cat > "$dir/cluster.json" <<EOC
{ "cluster": "statstest", "transport": "tcp", "gpus_per_node": 2, "nic_gbps": 10,
  "ipc_socket": "$dir/{node}.sock", "stats_socket": "$dir/{node}.stats", "http": "0",
  "nodes": [ { "name": "a", "control": "127.0.0.1:$1", "rails": ["127.0.0.1:$2", "127.0.0.1:$3"] },
             { "name": "b", "control": "127.0.0.1:$4", "rails": ["127.0.0.1:$5", "127.0.0.1:$6"] } ] }
EOC
pids=
for n in a b; do
	"$daemon" --config "$dir/cluster.json" --node $n >"$dir/$n.log" 2>&1 &
	pids="$pids $!"
done
# Wait until node a sees its peer (bounded).
i=0
while [ $i -lt 100 ]; do
	"$tool" stats --socket "$dir/a.stats" 2>/dev/null | grep -q '^peers_up 1/1' && break
	sleep 0.1; i=$((i + 1))
done
out=$("$tool" stats --socket "$dir/a.stats"); rc=$?
check [ $rc = 0 ]
check sh -c "echo '$out' | grep -q '^node a$'"
check sh -c "echo '$out' | grep -q '^peers_up 1/1$'"
rails=$("$tool" stats --socket "$dir/b.stats" stats rails | grep -c '^rail=')
check [ "$rails" = 2 ]
"$tool" stats --socket "$dir/a.stats" stats peers | grep -q 'peer' || { echo "FAIL: stats peers"; fail=1; }
err=$("$tool" stats --socket "$dir/a.stats" no such command); rc=$?
check [ $rc = 1 ]
check sh -c "echo '$err' | grep -q '^error'"
msg=$("$tool" stats --socket "$dir/none.stats" 2>&1); rc=$?
check [ $rc = 1 ]
check sh -c "echo '$msg' | grep -q 'is railwaved running'"
# The daemons are still serving after all of that.
check sh -c "'$tool' stats --socket '$dir/b.stats' | grep -q '^state running$'"
[ $fail = 0 ] && echo "railwave stats: ok"
exit $fail
