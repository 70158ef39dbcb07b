#!/bin/sh
# Prove the railvm guests with Debian's own RDMA tools before blaming our transport:
# ibv_rc_pingpong on both rails at once (raw verbs, hand-connected RC QPs), rping (librdmacm),
# ib_write_bw (RDMA WRITE through perftest, if installed) between guest 0 (server) and guest 1.
#   tests/rdma/vm/smoke.sh [railvm options]       exit 0 pass, 77 skip, 1 fail
set -u
here=$(cd "$(dirname "$0")" && pwd)
bins="$(command -v ibv_rc_pingpong) $(command -v rping)"
[ -n "$(command -v ibv_rc_pingpong)" ] && [ -n "$(command -v rping)" ] ||
	{ echo "smoke: SKIP: ibverbs-utils / rdmacm-utils missing"; exit 77; }
bw=$(command -v ib_write_bw)
[ -n "$bw" ] && bins="$bins $bw"
b=
for x in $bins; do b="$b -b $x"; done

# Guest 1 is the client: every step retries until guest 0's server for that step listens.
common='retry() { i=0; until "$@"; do i=$((i + 1)); [ $i -ge 30 ] && return 1; sleep 1; done; }
step() { echo "== $*"; }'
server="$common
step ibv_rc_pingpong rails 0 and 1
ibv_rc_pingpong -d rxe0 -g 1 -p 18515 -n 200 & p0=\$!
ibv_rc_pingpong -d rxe1 -g 1 -p 18516 -n 200 & p1=\$!
wait \$p0 || exit 1
wait \$p1 || exit 1
step rping
rping -s -a \$RW_IP_0 -C 20 -S 4096 -V || exit 1
if command -v ib_write_bw >/dev/null; then
	step ib_write_bw rail 1 rdma_cm
	ib_write_bw -d rxe1 -x 1 -R -s 65536 -n 500 --report_gbits || exit 1
fi
echo smoke-server-ok"
client="$common
step ibv_rc_pingpong rails 0 and 1
retry ibv_rc_pingpong -d rxe0 -g 1 -p 18515 -n 200 \$RW_PEER_IP_0 & p0=\$!
retry ibv_rc_pingpong -d rxe1 -g 1 -p 18516 -n 200 \$RW_PEER_IP_1 & p1=\$!
wait \$p0 || exit 1
wait \$p1 || exit 1
step rping
retry rping -c -a \$RW_PEER_IP_0 -C 20 -S 4096 -V || exit 1
if command -v ib_write_bw >/dev/null; then
	step ib_write_bw rail 1 rdma_cm
	retry ib_write_bw -d rxe1 -x 1 -R -s 65536 -n 500 --report_gbits \$RW_PEER_IP_1 || exit 1
fi
echo smoke-client-ok"
# shellcheck disable=SC2086
exec sh "$here/railvm.sh" $b -0 "$server" -1 "$client" "$@"
