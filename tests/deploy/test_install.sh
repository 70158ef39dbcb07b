#!/bin/sh
# scripts/install into a DESTDIR, then the installed result checked as systemd and a packager
# would: every file where PREFIX says, the binaries run and report the VERSION, the unit names
# the installed daemon, passes `systemd-analyze verify` without a single warning and rates at
# most 3.0 in `systemd-analyze security` while still allowing RDMA and NVIDIA devices; the
# sysusers.d entry creates the user inside the DESTDIR (systemd-sysusers --root) and the
# tmpfiles.d entry the socket directory with its owner and mode; librailwave (when the build
# has it) with its soname links, header and pkg-config file, a program compiled and linked
# against the staged copy runs. The installed tools run from the stage alone (no source tree,
# no build folder on their way): two staged daemons, then the staged `railwave calibrate --short`
# (its rw_bench_rank ranks, the table written and hot-loaded), `top --once`, `trace late`,
# `trace export` and `analyze` over the phase traces the daemons wrote. The default PREFIX
# (/usr/local) still reads its configuration from /etc/railwave. Bad invocations fail with a
# message. Exit 0 / 1 / 77 (skip).
set -u
b=$(cd "$(dirname "$0")/.." && pwd)       # the build folder: build/ or build-asan/
src=$(cd "$b/.." && pwd)
[ -x "$b/railwaved" ] && [ -x "$b/tools/railwave" ] || { echo "SKIP: build first"; exit 77; }
tmp=$(mktemp -d /tmp/rwinstall.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail=0
no() { echo "FAIL: $*"; fail=1; }
version=$(cat "$src/VERSION")

# ---- PREFIX=/usr into a DESTDIR (what a Debian package does) ----------------------------------
st=$tmp/usr-stage
PREFIX=/usr DESTDIR=$st sh "$src/scripts/install" "$b" >"$tmp/list" 2>"$tmp/err" || { no "install failed"; cat "$tmp/err"; }
for f in usr/sbin/railwaved usr/bin/railwave usr/lib/systemd/system/railwaved.service \
	 usr/lib/sysusers.d/railwave.conf usr/lib/tmpfiles.d/railwave.conf \
	 usr/share/doc/railwave/service.md usr/share/doc/railwave/README.md \
	 usr/share/railwave/clusters/loopback-4x4.json usr/share/railwave/anchors/example-4x8x8.json; do
	[ -f "$st/$f" ] || no "$f not installed"
	grep -qx "/$f" "$tmp/list" || no "/$f not listed"
done
[ -d "$st/etc/railwave" ] || no "/etc/railwave not created"
[ "$(stat -c %a "$st/usr/sbin/railwaved")" = 755 ] || no "railwaved mode"
[ "$(stat -c %a "$st/usr/lib/systemd/system/railwaved.service")" = 644 ] || no "unit mode"
[ "$("$st/usr/sbin/railwaved" --version)" = "railwaved $version" ] || no "railwaved --version"
[ "$("$st/usr/bin/railwave" --version)" = "railwave $version" ] || no "railwave --version"
[ -z "$(find "$st" -newer "$tmp/list" -prune -o -name '*.in' -print)" ] || no "a template was installed"
# One release version: VERSION, the Python package's, the installed railwave.pc's (checked below).
grep -qx "version = \"$version\"" "$src/python/pyproject.toml" || no "python/pyproject.toml's version is not VERSION ($version)"
grep -q "^__version__ = \"$version\"" "$src/python/railwave/__init__.py" || no "railwave.__version__ is not VERSION ($version)"
[ ! -f "$b/lib/pkgconfig/railwave.pc" ] || grep -qx "Version: $version" "$b/lib/pkgconfig/railwave.pc" ||
	no "the build tree's railwave.pc is not VERSION ($version): $(grep Version "$b/lib/pkgconfig/railwave.pc")"

unit=$st/usr/lib/systemd/system/railwaved.service
grep -qx 'ExecStart=/usr/sbin/railwaved --config /etc/railwave/cluster.json' "$unit" || no "ExecStart not rewritten"
grep -qx 'Documentation=file:///usr/share/doc/railwave/service.md' "$unit" || no "Documentation not rewritten"
doc=$(sed -n 's|^Documentation=file://||p' "$unit")
[ -f "$st$doc" ] || no "the unit's Documentation= ($doc) is not installed"
# The NVIDIA groups are the names a current driver registers in /proc/devices (580 on an H200:
# nvidia, nvidiactl, nvidia-uvm, nvidia-caps); systemd ignores a name the kernel lacks.
for want in 'Type=notify' 'NotifyAccess=main' 'LimitMEMLOCK=infinity' 'RestartPreventExitStatus=2' \
	    'DeviceAllow=char-infiniband_verbs rw' 'DeviceAllow=/dev/infiniband/rdma_cm rw' \
	    'DeviceAllow=char-nvidia rw' 'DeviceAllow=char-nvidiactl rw' 'DeviceAllow=char-nvidia-uvm rw' \
	    'DeviceAllow=char-nvidia-caps r' 'RuntimeDirectory=railwave' 'LogsDirectory=railwave' \
	    'StartLimitBurst=10' 'LoadCredential=cluster.key:/etc/railwave/cluster.key'; do
	grep -qx "$want" "$unit" || no "unit lacks '$want'"
done
grep -q '^RestrictAddressFamilies=.*AF_NETLINK' "$unit" || no "unit forbids netlink (libibverbs needs it)"
grep -q '^WatchdogSec=' "$unit" || no "unit has no WatchdogSec"
grep -q '^After=.*nvidia-persistenced.service' "$unit" || no "unit not ordered after the NVIDIA driver's units"

if command -v systemd-analyze >/dev/null 2>&1; then
	# verify the installed unit with its binary path pointed into the stage; any output is a
	# warning (unknown key, bad value) and counts as a failure, as does a non-zero status.
	sed "s|^ExecStart=/usr/sbin/|ExecStart=$st/usr/sbin/|" "$unit" >"$tmp/railwaved.service"
	out=$(cd "$tmp" && systemd-analyze verify "$tmp/railwaved.service" 2>&1); rc=$?
	[ $rc = 0 ] && [ -z "$out" ] || no "systemd-analyze verify: rc $rc: $out"
	score=$(systemd-analyze security --offline=yes "$tmp/railwaved.service" 2>&1 |
		sed -n 's/.*Overall exposure level for railwaved.service: \([0-9.]*\).*/\1/p')
	echo "systemd-analyze security: exposure $score"
	[ -n "$score" ] && awk -v s="$score" 'BEGIN { exit !(s <= 3.0) }' || no "exposure '$score' > 3.0"
else
	echo "note: no systemd-analyze; unit not verified"
fi

if command -v systemd-sysusers >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
	mkdir -p "$st/etc"
	systemd-sysusers --root="$st" >/dev/null 2>&1 || no "systemd-sysusers --root failed"
	grep -q '^railwave:x:[0-9]*:[0-9]*:RailWave daemon:/run/railwave:/usr/sbin/nologin$' "$st/etc/passwd" ||
		no "sysusers.d did not create user railwave: $(cat "$st/etc/passwd" 2>&1)"
	grep -q '^railwave:x:' "$st/etc/group" || no "sysusers.d did not create group railwave"
	systemd-tmpfiles --root="$st" --create "$st/usr/lib/tmpfiles.d/railwave.conf" 2>"$tmp/tf" || no "systemd-tmpfiles: $(cat "$tmp/tf")"
	uid=$(awk -F: '$1 == "railwave" { print $3 }' "$st/etc/passwd")
	[ "$(stat -c '%a %u' "$st/run/railwave" 2>&1)" = "750 $uid" ] || no "tmpfiles.d: /run/railwave is $(stat -c '%a %u' "$st/run/railwave" 2>&1), want 750 $uid"
else
	echo "note: not root or no systemd-sysusers; sysusers.d/tmpfiles.d not applied"
fi

if ls "$b"/lib/librailwave.so.*.*.* >/dev/null 2>&1 && [ -f "$src/ipc/railwave.pc.in" ]; then
	lib=$st/usr/lib
	real=$(basename "$(ls "$b"/lib/librailwave.so.*.*.* | head -n 1)")
	[ -f "$lib/$real" ] || no "$real not installed"
	[ "$(readlink "$lib/librailwave.so.1")" = "$real" ] || no "librailwave.so.1 link"
	[ "$(readlink "$lib/librailwave.so")" = librailwave.so.1 ] || no "librailwave.so link"
	[ -f "$st/usr/include/railwave.h" ] || no "railwave.h not installed"
	pc=$lib/pkgconfig/railwave.pc
	grep -q '@' "$pc" && no "railwave.pc keeps a placeholder: $(grep @ "$pc")"
	grep -qx "Version: $version" "$pc" || no "railwave.pc's Version is not VERSION ($version): $(grep Version "$pc")"
	flags=$(PKG_CONFIG_SYSROOT_DIR=$st PKG_CONFIG_LIBDIR=$lib/pkgconfig pkg-config --cflags --libs railwave) || no "pkg-config"
	printf '#include <railwave.h>\n#include <stdio.h>\nint main(void) { printf("%%s\\n", RW_DEFAULT_SOCKET); return 0; }\n' >"$tmp/p.c"
	# shellcheck disable=SC2086
	cc "$tmp/p.c" -o "$tmp/p" $flags -Wl,--no-as-needed -lrailwave 2>"$tmp/cc" || no "compile against the staged library: $(cat "$tmp/cc")"
	[ "$(LD_LIBRARY_PATH=$lib "$tmp/p")" = /run/railwave/railwaved.sock ] || no "the linked program did not run"
	LD_LIBRARY_PATH=$lib ldd "$tmp/p" | grep -q "librailwave.so.1 => $lib/librailwave.so.1" || no "not linked by soname"
else
	echo "note: this build has no librailwave.so; library install not checked"
fi

# ---- the installed tools, run from the stage ------------------------------------------------------
# Nothing of the source tree or the build folder is on their way: RAILWAVE_SRC is unset and the
# staged binaries find their helpers in the stage's libexec/railwave (tools/pyexec.c).
for f in usr/libexec/railwave/tools/observe.py usr/libexec/railwave/tools/calibrate.py \
	 usr/libexec/railwave/tools/bench_bed.py usr/libexec/railwave/tools/rw_bench_rank \
	 usr/libexec/railwave/tests/testbed/testbed.sh; do
	[ -f "$st/$f" ] || no "$f not installed"
done
[ "$(readlink -f "$st/usr/libexec/railwave/railwaved")" = "$(readlink -f "$st/usr/sbin/railwaved")" ] ||
	no "libexec/railwave/railwaved does not lead to the installed daemon"
rw=$st/usr/bin/railwave
python3 - "$tmp" <<'EOP'
import json, socket, sys
tmp = sys.argv[1]
def port(ip):
    s = socket.socket(); s.bind((ip, 0)); p = s.getsockname()[1]; s.close(); return p
nodes = [{"name": "n%d" % i, "control": "127.0.0.%d:%d" % (i + 1, port("127.0.0.%d" % (i + 1))),
          "rails": ["127.0.%d.%d:%d" % (r, i + 1, port("127.0.%d.%d" % (r, i + 1))) for r in range(2)]}
         for i in range(2)]
json.dump({"cluster": "installtest", "transport": "tcp", "gpus_per_node": 2, "http": "0",
           "ipc_socket": tmp + "/run/{node}.sock", "stats_socket": tmp + "/run/{node}.stats",
           "trace_dir": tmp + "/traces", "anchors": tmp + "/anchors.json",
           "recv_region_mib": 8, "nodes": nodes}, open(tmp + "/cluster.json", "w"))
json.dump({"schema_version": 1, "fingerprint": {"nodes": 2, "gpus_per_node": 2, "rails": 2,
           "nic_gbps": 100.0, "transport": "tcp"}, "max_size_ratio": 4, "shape_tolerance": 0.15,
           "anchors": []}, open(tmp + "/anchors.json", "w"))
EOP
mkdir -p "$tmp/run" "$tmp/traces"
( cd / && env -u RAILWAVE_SRC "$st/usr/sbin/railwaved" --config "$tmp/cluster.json" --node n0 >"$tmp/n0.log" 2>&1 & echo $! >"$tmp/n0.pid" )
( cd / && env -u RAILWAVE_SRC "$st/usr/sbin/railwaved" --config "$tmp/cluster.json" --node n1 >"$tmp/n1.log" 2>&1 & echo $! >"$tmp/n1.pid" )
stop_daemons() {
	for n in n0 n1; do [ -f "$tmp/$n.pid" ] && kill "$(cat "$tmp/$n.pid")" 2>/dev/null; done
	for n in n0 n1; do
		[ -f "$tmp/$n.pid" ] || continue
		i=0; while kill -0 "$(cat "$tmp/$n.pid")" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
		rm -f "$tmp/$n.pid"
	done
}
trap 'stop_daemons; rm -rf "$tmp"' EXIT
tools_ok=1
for n in n0 n1; do
	"$rw" wait --quiet --socket "$tmp/run/$n.stats" --timeout 30 || { no "staged daemon $n not ready: $(tail -n 3 "$tmp/$n.log")"; tools_ok=0; }
done
if [ $tools_ok = 1 ]; then
	wl="--experts 8 --topk 2 --hidden 256 --tokens 32"
	# shellcheck disable=SC2086
	(cd / && env -u RAILWAVE_SRC "$rw" calibrate --config "$tmp/cluster.json" --short --reps 2 $wl) >"$tmp/cal.out" 2>&1 ||
		no "installed calibrate --short: $(tail -n 5 "$tmp/cal.out")"
	grep -q "^wrote $tmp/anchors.json: 2 anchors" "$tmp/cal.out" || no "installed calibrate wrote no table: $(tail -n 5 "$tmp/cal.out")"
	"$rw" stats --socket "$tmp/run/n1.stats" | grep -qx 'anchors 2' || no "the daemons did not load the calibrated table"
	(cd / && env -u RAILWAVE_SRC "$rw" top --once --interval 0.2 --socket "$tmp/run/n0.stats" --socket "$tmp/run/n1.stats") >"$tmp/top.out" 2>&1 ||
		no "installed top --once: $(tail -n 3 "$tmp/top.out")"
	grep -q 'n0' "$tmp/top.out" && grep -q 'n1' "$tmp/top.out" || no "top --once shows not both daemons: $(cat "$tmp/top.out")"
	# the compact view: a header and one line per daemon
	(cd / && env -u RAILWAVE_SRC "$rw" top --once --compact --interval 0.2 --socket "$tmp/run/n0.stats" --socket "$tmp/run/n1.stats") >"$tmp/topc.out" 2>&1 ||
		no "installed top --once --compact: $(tail -n 3 "$tmp/topc.out")"
	[ "$(wc -l <"$tmp/topc.out")" = 3 ] && grep -q '^node  *state  *peers' "$tmp/topc.out" &&
		grep -q '^n0  *running  *1/1 ' "$tmp/topc.out" && grep -q '^n1  *running  *1/1 ' "$tmp/topc.out" ||
		no "top --compact is not one line per daemon: $(cat "$tmp/topc.out")"
	stop_daemons   # the traces are flushed at shutdown
	(cd / && env -u RAILWAVE_SRC "$rw" trace late "$tmp/traces") >"$tmp/late.out" 2>&1 || no "installed trace late: $(tail -n 3 "$tmp/late.out")"
	(cd / && env -u RAILWAVE_SRC "$rw" trace export "$tmp/traces" -o "$tmp/t.json") >"$tmp/exp.out" 2>&1 || no "installed trace export: $(tail -n 3 "$tmp/exp.out")"
	python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); ev = d["traceEvents"] if isinstance(d, dict) else d; sys.exit(0 if len(ev) > 0 else 1)' "$tmp/t.json" ||
		no "trace export wrote no events"
	(cd / && env -u RAILWAVE_SRC "$rw" analyze "$tmp/traces" --json) >"$tmp/an.json" 2>"$tmp/an.err" || no "installed analyze: $(tail -n 3 "$tmp/an.err")"
	python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["phases"] > 0 else 1)' "$tmp/an.json" ||
		no "analyze found no phases: $(head -c 300 "$tmp/an.json")"
	echo "installed tools: calibrate, top, trace, analyze ran from the stage"
fi

# ---- default PREFIX=/usr/local: unit in /usr/local/lib, configuration and sysusers.d/tmpfiles.d in /etc
st2=$tmp/local-stage
DESTDIR=$st2 sh "$src/scripts/install" "$b" >/dev/null 2>&1 || no "install (PREFIX=/usr/local) failed"
grep -qx 'ExecStart=/usr/local/sbin/railwaved --config /etc/railwave/cluster.json' \
	"$st2/usr/local/lib/systemd/system/railwaved.service" || no "/usr/local unit"
grep -qx 'LoadCredential=cluster.key:/etc/railwave/cluster.key' \
	"$st2/usr/local/lib/systemd/system/railwaved.service" || no "/usr/local unit: key not from /etc/railwave"
[ -d "$st2/etc/railwave" ] && [ ! -e "$st2/usr/local/etc" ] || no "PREFIX=/usr/local: configuration folder not /etc/railwave"
[ -f "$st2/etc/sysusers.d/railwave.conf" ] && [ -f "$st2/etc/tmpfiles.d/railwave.conf" ] ||
	no "sysusers.d/tmpfiles.d not under /etc for PREFIX=/usr/local"
[ "$(readlink "$st2/usr/local/libexec/railwave/railwaved")" = ../../sbin/railwaved ] ||
	no "libexec link is not relative: $(readlink "$st2/usr/local/libexec/railwave/railwaved")"

# ---- bad invocations ----------------------------------------------------------------------------
msg=$(DESTDIR=$tmp/x sh "$src/scripts/install" "$tmp/nobuild" 2>&1); rc=$?
[ $rc = 1 ] && echo "$msg" | grep -q "no $tmp/nobuild/railwaved" || no "missing build: rc $rc: $msg"
msg=$(PREFIX=usr DESTDIR=$tmp/x sh "$src/scripts/install" "$b" 2>&1); rc=$?
[ $rc = 2 ] && echo "$msg" | grep -q "PREFIX must be absolute" || no "relative PREFIX: rc $rc: $msg"
[ ! -e "$tmp/x" ] || no "a failed install wrote files"

[ $fail = 0 ] && echo "install: ok"
exit $fail
