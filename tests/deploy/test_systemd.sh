#!/bin/sh
# The README's "Running on a cluster" on a fresh system booted by a real systemd: a container
# (systemd-nspawn, Debian's systemd-container) whose /usr is this machine's (read-only), with an
# empty /usr/local and /etc of its own; the source tree (and this build) read-only at /src.
# Inside it, as root, literally the documented commands:
#   sh scripts/install (default PREFIX /usr/local); systemd-sysusers; systemd-tmpfiles --create;
#   railwave keygen; install -m 0600 cluster.key /etc/railwave/; cp cluster.json /etc/railwave/;
#   systemctl daemon-reload; systemctl enable --now railwaved; railwave wait
# and then: the unit is active with its READY status line, it read /etc/railwave/cluster.json
# (stats: the file's cluster name) and the key through LoadCredential (auth key), its trace_dir
# /var/log/railwave (LogsDirectory=) is written under ProtectSystem=strict, `railwave wait`
# reaches the second node (a daemon outside the container, same key) on every rail; a trainer
# built with `pkg-config --cflags --libs railwave` runs without LD_LIBRARY_PATH (ldconfig); a
# user outside group railwave asking `railwave stats` is told to join the group;
# a configuration error (an unknown key) exits 2, is not restarted, and its reason is in
# `journalctl -u railwaved -p err`; `systemctl stop` drains and exits 0.
# Needs root, systemd-nspawn, nsenter; release build only (skips under ASan). Exit 0/1/77.
# RW_TEST_KEEP=1 keeps the folder.
set -u
b=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$b/.." && pwd)
bname=$(basename "$b")
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root (a container)"; exit 77; }
for c in systemd-nspawn nsenter unshare; do
	command -v $c >/dev/null 2>&1 || { echo "SKIP: no $c (scripts/setup installs systemd-container)"; exit 77; }
done
[ -x /usr/lib/systemd/systemd ] || { echo "SKIP: no systemd in /usr"; exit 77; }
[ -x "$b/railwaved" ] && [ -x "$b/tools/railwave" ] || { echo "SKIP: build first"; exit 77; }
ldd "$b/railwaved" | grep -q libasan && { echo "SKIP: sanitizer build (the release build runs this)"; exit 77; }

T=$(mktemp -d /tmp/rwsystemd.XXXXXX)
chmod 755 "$T"
fail=0
no() { echo "FAIL: $*"; fail=1; }
ns= peer=
cleanup() {
	[ -n "$peer" ] && kill "$peer" 2>/dev/null
	if [ -n "$ns" ]; then
		kill -TERM "$ns" 2>/dev/null   # nspawn: the container powers off
		i=0; while kill -0 "$ns" 2>/dev/null && [ $i -lt 150 ]; do sleep 0.1; i=$((i + 1)); done
		kill -KILL "$ns" 2>/dev/null
	fi
	[ -n "${RW_TEST_KEEP:-}" ] && echo "kept $T" || rm -rf "$T"
}
trap cleanup EXIT

# ---- the container's root: its own /etc and /usr/local, this machine's /usr --------------------
R=$T/root
mkdir -p "$R/etc/ld.so.conf.d" "$R/usr" "$R/var" "$R/tmp" "$R/root" "$R/run" "$R/src" "$T/local"
for d in bin sbin lib lib64; do ln -s usr/$d "$R/$d"; done
cp /usr/lib/os-release "$R/etc/os-release"
: > "$R/etc/machine-id"
echo 'root:x:0:0:root:/root:/bin/sh' > "$R/etc/passwd"
echo 'root:x:0:' > "$R/etc/group"
# What Debian's packages put in /etc for /usr to work: the alternatives (cc, pkg-config) and the
# loader's configuration (libc6: /usr/local/lib is searched).
cp -a /etc/alternatives "$R/etc/"
cp /etc/ld.so.conf "$R/etc/" 2>/dev/null
for f in /etc/ld.so.conf.d/*.conf; do
	case "$f" in */railwave.conf) ;; *) cp "$f" "$R/etc/ld.so.conf.d/" ;; esac
done

# nspawn keeps its mount propagation folder on a tmpfs it expects under /run; give it one in a
# mount namespace of its own where /run is not (a plain container or chroot as this machine).
mkdir -p /run/systemd/nspawn
unshare -m --propagation private sh -c '
	mountpoint -q /run/systemd/nspawn || mount -t tmpfs tmpfs /run/systemd/nspawn || exit 1
	exec systemd-nspawn -q -D "$1" --register=no --keep-unit --bind-ro=/usr --bind="$2":/usr/local \
		--bind-ro="$3":/src -b --console=pipe' sh "$R" "$T/local" "$src" >"$T/boot.log" 2>&1 </dev/null &
ns=$!
cpid=
i=0
while [ $i -lt 300 ]; do
	cpid=$(pgrep -P "$ns" 2>/dev/null | head -n 1)
	if [ -n "$cpid" ]; then
		st=$(nsenter -t "$cpid" -m -p env -i PATH=/usr/bin:/usr/sbin systemctl is-system-running 2>/dev/null)
		case "$st" in running|degraded) break ;; esac
	fi
	kill -0 "$ns" 2>/dev/null || break
	sleep 0.2; i=$((i + 1))
done
case "${st:-}" in
running|degraded) echo "container booted ($st) in $((i / 5)) s" ;;
*) echo "SKIP: systemd did not boot in the container (state '${st:-}'): $(tail -n 5 "$T/boot.log")"; exit 77 ;;
esac
# inside CMD...: run CMD as root inside the container, with its PATH.
inside() {
	nsenter -t "$cpid" -m -u -i -n -p env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin \
		sh -c 'cd /root && exec "$@"' sh "$@"
}

# ---- a two-node cluster on loopback: n0 is the unit, n1 a daemon outside the container ---------
python3 - "$T/cluster.json" <<'EOP'
import json, socket, sys
def port(ip):
    s = socket.socket(); s.bind((ip, 0)); p = s.getsockname()[1]; s.close(); return p
nodes = [{"name": "n%d" % i, "control": "127.0.0.%d:%d" % (i + 1, port("127.0.0.%d" % (i + 1))),
          "rails": ["127.0.%d.%d:%d" % (r, i + 1, port("127.0.%d.%d" % (r, i + 1))) for r in range(2)]}
         for i in range(2)]
nodes[1]["ipc_socket"] = sys.argv[1] + ".n1.sock"
nodes[1]["stats_socket"] = sys.argv[1] + ".n1.stats"
json.dump({"cluster": "unitcheck", "node": "n0", "transport": "tcp", "gpus_per_node": 2, "http": "0",
           "trace_dir": "/var/log/railwave", "recv_region_mib": 4, "nodes": nodes},
          open(sys.argv[1], "w"), indent=1)
EOP
cp "$T/cluster.json" "$R/root/cluster.json"

# ---- the documented install, inside ------------------------------------------------------------
inside sh /src/scripts/install "/src/$bname" >"$T/install.out" 2>&1 || no "scripts/install: $(tail -n 5 "$T/install.out")"
[ -f "$T/local/sbin/railwaved" ] && [ -f "$T/local/lib/systemd/system/railwaved.service" ] ||
	no "not installed under /usr/local: $(tail -n 5 "$T/install.out")"
[ -d "$R/etc/railwave" ] || no "/etc/railwave not created"
inside systemd-sysusers >"$T/sys.out" 2>&1 || no "systemd-sysusers: $(cat "$T/sys.out")"
# Its status is not ours: the borrowed /usr has other packages' tmpfiles.d entries for users
# their maintainer scripts (never run here) would have made. /run/railwave is what counts.
inside systemd-tmpfiles --create >"$T/tmpfiles.out" 2>&1
[ "$(inside stat -c '%U:%G %a' /run/railwave)" = "railwave:railwave 750" ] ||
	no "systemd-tmpfiles --create: /run/railwave is $(inside stat -c '%U:%G %a' /run/railwave 2>&1)"
inside railwave keygen cluster.key >/dev/null || no "railwave keygen"
inside install -m 0600 cluster.key /etc/railwave/ || no "install -m 0600 cluster.key /etc/railwave/ (as the README says)"
inside cp cluster.json /etc/railwave/ || no "cp cluster.json /etc/railwave/"
cp "$R/root/cluster.key" "$T/cluster.key"; chmod 600 "$T/cluster.key"
"$b/railwaved" --config "$T/cluster.json" --node n1 --key-file "$T/cluster.key" >"$T/n1.log" 2>&1 &
peer=$!
inside sh -c 'systemctl daemon-reload && systemctl enable --now railwaved' >"$T/enable.out" 2>&1 ||
	no "systemctl enable --now railwaved: $(cat "$T/enable.out"; inside journalctl -u railwaved --no-pager | tail -n 8)"
inside railwave wait --timeout 30 >"$T/wait.out" 2>&1 || no "railwave wait: $(cat "$T/wait.out")"
i=0   # STATUS= follows the peer count at the next health tick
while [ $i -lt 50 ]; do
	show=$(inside systemctl show -p ActiveState -p SubState -p StatusText -p NRestarts -p ExecMainStatus railwaved)
	echo "$show" | grep -q '^StatusText=ready' && break
	sleep 0.1; i=$((i + 1))
done
echo "$show" | grep -qx 'ActiveState=active' && echo "$show" | grep -qx 'SubState=running' ||
	no "unit not active/running: $show $(inside journalctl -u railwaved --no-pager | tail -n 8)"
echo "$show" | grep -q '^StatusText=ready: 1/1 peers up' || no "no READY status line: $show"
stats=$(inside railwave stats)
echo "$stats" | grep -qx 'cluster unitcheck' || no "the unit did not read /etc/railwave/cluster.json: $stats"
echo "$stats" | grep -qx 'auth key' || no "the key did not reach the daemon (LoadCredential): $stats"
inside journalctl -u railwaved --no-pager >"$T/journal.out" 2>&1
grep -q 'trace: phase records go to /var/log/railwave/n0.trace.jsonl' "$T/journal.out" &&
	[ -f "$R/var/log/railwave/n0.trace.jsonl" ] || no "trace_dir under LogsDirectory not written: $(grep trace "$T/journal.out")"
[ "$(inside stat -c %U /var/log/railwave)" = railwave ] || no "/var/log/railwave is not the daemon's"
# A user outside group railwave is told to join it (the sockets are the group's), not that the
# daemon is down.
msg=$(inside setpriv --reuid=65534 --regid=65534 --clear-groups railwave stats 2>&1)
echo "$msg" | grep -q 'Permission denied (join group railwave' || no "railwave stats as a non-member: $msg"

# ---- a trainer linked by pkg-config finds the library through the loader's cache ----------------
printf '#include <railwave.h>\n#include <stdio.h>\nint main(void) { printf("%%s\\n", RW_DEFAULT_SOCKET); return 0; }\n' >"$R/root/p.c"
inside sh -c 'cc p.c -o p $(pkg-config --cflags --libs railwave)' >"$T/cc.out" 2>&1 || no "cc with pkg-config railwave: $(cat "$T/cc.out")"
[ "$(inside ./p 2>&1)" = /run/railwave/railwaved.sock ] || no "a program linked with librailwave does not run (ldconfig?): $(inside ./p 2>&1)"

# ---- a configuration error: exit 2, no restart, the reason at priority err ----------------------
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["rail"] = 1; json.dump(c, open(sys.argv[1], "w"))' "$R/etc/railwave/cluster.json"
inside systemctl restart railwaved >/dev/null 2>&1 && no "a start with an unknown key succeeded"
sleep 7   # longer than RestartSec: a restart would have happened
show=$(inside systemctl show -p ActiveState -p NRestarts -p ExecMainStatus railwaved)
echo "$show" | grep -qx 'ExecMainStatus=2' || no "configuration error: exit status not 2: $show"
echo "$show" | grep -qx 'NRestarts=0' || no "configuration error restarted: $show"
inside journalctl -u railwaved -p err --no-pager -o cat >"$T/err.out" 2>&1
grep -q 'railwaved: configuration: /etc/railwave/cluster.json: rail: unknown field' "$T/err.out" ||
	no "journalctl -p err does not show why it failed: $(cat "$T/err.out")"
python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); del c["rail"]; json.dump(c, open(sys.argv[1], "w"))' "$R/etc/railwave/cluster.json"

# ---- stop: drained, exit 0 ------------------------------------------------------------------------
inside sh -c 'systemctl reset-failed railwaved; systemctl start railwaved && systemctl stop railwaved' >"$T/stop.out" 2>&1 ||
	no "start/stop after the fix: $(cat "$T/stop.out")"
show=$(inside systemctl show -p ActiveState -p Result railwaved)
echo "$show" | grep -qx 'Result=success' || no "stop: $show"

[ $fail = 0 ] || { echo "---- journal ----"; inside journalctl -u railwaved --no-pager | tail -n 25; }
[ $fail = 0 ] && echo "systemd: ok"
exit $fail
