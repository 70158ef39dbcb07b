#!/bin/sh
# `railwave sim-replay` (tools/sim_replay.c): a recorded matrix gives every path for dispatch and
# combine, each at or above the lower bound, Rail-only exactly at it when every pair splits evenly
# (counts 2 per rail); bad lines are refused with the line number and exit 1; later lines are not
# read after a bad one.
set -u
b=$(cd "$(dirname "$0")/.." && pwd)
tool="$b/tools/railwave"
[ -x "$tool" ] || { echo "SKIP: build railwave first"; exit 77; }
fail=0
check() { if ! "$@"; then echo "FAIL: $*"; fail=1; fi; }
good='{"id":7,"nodes":3,"rails":2,"gpus":2,"counts":[0,0,4,0,2,2,0,4,0,0,2,2,2,2,2,2,0,0],"record_bytes":1000,"combine_record_bytes":500,"gbps":[8,8]}'
out=$(printf '%s\n' "$good" | "$tool" sim-replay -); rc=$?
check [ $rc = 0 ]
check python3 - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
assert r["id"] == 7, r
for kind, rec in (("dispatch", 1000), ("combine", 500)):
    k = r[kind]
    # busiest NIC under RailBalance: each pair of 4 records splits 2/2, node 0 egress per rail
    # = 2 (to 1) + 2 (to 2) records; at 1 GB/s
    assert abs(k["lower_bound_s"] - 4 * rec / 1e9) < 1e-12, (kind, k)
    for p, v in k["paths"].items():
        assert v["ratio"] >= 1 - 1e-9, (kind, p, v)
    assert abs(k["paths"]["rail-only"]["ratio"] - 1) < 1e-9, (kind, k)
    # native: node 0 sends 4 + 2 records on rail 0 (node 1 likewise on rail 1): 6 / 4
    assert abs(k["paths"]["native"]["ratio"] - 1.5) < 1e-9, (kind, k)
print("ok")
PY
for bad in 'not json' '{"nodes":3}' \
	'{"nodes":3,"rails":2,"gpus":2,"counts":[1,2],"record_bytes":1,"combine_record_bytes":1,"gbps":[1,1]}' \
	'{"nodes":2,"rails":1,"gpus":1,"counts":[0,-1,0,0],"record_bytes":1,"combine_record_bytes":1,"gbps":[1]}' \
	'{"nodes":2,"rails":1,"gpus":1,"counts":[0,1,0,0],"record_bytes":1,"combine_record_bytes":1,"gbps":[0]}'; do
	msg=$(printf '%s\n%s\n' "$good" "$bad" | "$tool" sim-replay - 2>&1 >/dev/null); rc=$?
	check [ $rc = 1 ]
	case "$msg" in *"-:2: "*) ;; *) echo "FAIL: no line number for '$bad': $msg"; fail=1 ;; esac
done
n=$(printf '%s\nnot json\n%s\n' "$good" "$good" | "$tool" sim-replay - 2>/dev/null | wc -l)
check [ "$n" = 1 ]
"$tool" sim-replay /nonexistent 2>/dev/null; check [ $? = 1 ]
[ $fail = 0 ] && echo "railwave sim-replay: ok"
exit $fail
