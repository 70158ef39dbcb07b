#!/bin/sh
# RailWave rail test bed: an emulated rail-optimized cluster on one machine.
#   N network namespaces (nodes) x R rails. Rail r is a Linux bridge (the rail switch); NIC r of
#   node n is a veth pair whose inner end "rail<r>" lives in the node's namespace with address
#   10.77.<r>.<n+1>/24 and whose outer end is a port of bridge r. tc tbf shapes BOTH the inner
#   end's egress (NIC transmit) and the outer end's egress (switch port -> NIC = NIC receive), so
#   receiver ingress is a real bottleneck. A management bridge (10.78.0.0/24, root side .254)
#   gives launchers (mpirun) a path that carries no data.
#
#   testbed.sh up   [-n NODES] [-r RAILS] [-m MBIT] [-d DELAY_MS] [-M MTU] [-p PREFIX]
#   testbed.sh down [-p PREFIX]          remove everything with PREFIX (also debris of old runs)
#   testbed.sh exec NODE CMD...          run CMD inside node NODE's namespace
#   testbed.sh status [-p PREFIX]        list what exists
# Requires root and iproute2. Addresses exist only inside these namespaces.
set -eu

prefix=${RW_TESTBED_PREFIX:-rwtb}
nodes=4 rails=4 mbit=50 delay=0 prio_band=1
# Rail NICs use jumbo frames, as RDMA fabrics do (RoCE runs 4096-byte MTUs on 9000-byte
# Ethernet): at 1500 bytes this 2-core machine spends its CPU on per-packet work in the
# emulated switches before the shaped NICs are full.
mtu=9000

die() { echo "testbed: $*" >&2; exit 1; }
ns_name() { echo "${prefix}-n$1"; }

parse_opts() {
	while getopts n:r:m:d:M:p: opt; do
		case $opt in
		n) nodes=$OPTARG ;; r) rails=$OPTARG ;; m) mbit=$OPTARG ;;
		d) delay=$OPTARG ;; M) mtu=$OPTARG ;; p) prefix=$OPTARG ;; *) die "bad option" ;;
		esac
	done
}

# Shape egress of a device to $mbit (plus optional delay via netem as the parent). Under the
# shaper, a strict two-band priority (an HTB whose classes never run out of rate) sends packets
# shorter than 512 bytes — TCP acknowledgements, the transport's write ACK frames — ahead of bulk
# data, as a switch's control-traffic queue does: otherwise a node's write ACK waits behind the
# same NIC's outbound backlog (tens of ms under tbf's 200 ms FIFO; measured 60 ms), and every
# wave barrier pays for it.
shape() {
	dev=$1; shift
	burst=$(( mbit * 1000000 / 8 / 250 )) # 4 ms worth of bytes
	[ "$burst" -lt 16000 ] && burst=16000
	tbf="tbf rate ${mbit}mbit burst $burst latency 200ms"
	if [ "$delay" != 0 ]; then
		"$@" tc qdisc add dev "$dev" root handle 1: netem delay "${delay}ms"
		"$@" tc qdisc add dev "$dev" parent 1:1 handle 10: $tbf
	else
		"$@" tc qdisc add dev "$dev" root handle 10: $tbf
	fi
	[ "$prio_band" = 1 ] || return 0
	"$@" tc qdisc add dev "$dev" parent 10:1 handle 20: htb default 2
	"$@" tc class add dev "$dev" parent 20: classid 20:1 htb rate 10gbit quantum 20000 prio 0
	"$@" tc class add dev "$dev" parent 20: classid 20:2 htb rate 10gbit quantum 20000 prio 1
	"$@" tc filter add dev "$dev" parent 20: protocol ip prio 1 u32 \
		match u16 0x0000 0xfe00 at 2 flowid 20:1
}

down() {
	for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${prefix}-n" || true); do
		# Kill whatever still runs inside, then the namespace (its veth ends go with it).
		pids=$(ip netns pids "$ns" 2>/dev/null || true)
		[ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
		ip netns del "$ns" 2>/dev/null || true
	done
	for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^${prefix}-" || true); do
		ip link del "$dev" 2>/dev/null || true
	done
}

# Whether this kernel has a qdisc: try it on a throwaway veth pair.
qdisc_works() {
	probe="${prefix}-q"
	ip link add "$probe" type veth peer name "${probe}p" 2>/dev/null || return 1
	tc qdisc add dev "$probe" root "$@" 2>/dev/null
	rc=$?
	ip link del "$probe" 2>/dev/null
	return $rc
}

# Whether the priority band under the shaper can be built (htb qdisc and u32 filter).
prio_works() {
	probe="${prefix}-q"
	ip link add "$probe" type veth peer name "${probe}p" 2>/dev/null || return 1
	tc qdisc add dev "$probe" root handle 20: htb default 2 2>/dev/null &&
		tc class add dev "$probe" parent 20: classid 20:1 htb rate 10gbit prio 0 2>/dev/null &&
		tc filter add dev "$probe" parent 20: protocol ip prio 1 u32 \
			match u16 0x0000 0xfe00 at 2 flowid 20:1 2>/dev/null
	rc=$?
	ip link del "$probe" 2>/dev/null
	return $rc
}

up() {
	[ "$(id -u)" = 0 ] || die "needs root"
	command -v ip >/dev/null || die "needs iproute2 (ip)"
	[ "$nodes" -ge 2 ] && [ "$nodes" -le 200 ] || die "nodes must be 2..200"
	[ "$rails" -ge 1 ] && [ "$rails" -le 16 ] || die "rails must be 1..16"
	[ "$delay" = 0 ] || qdisc_works netem delay 1ms ||
		die "-d needs the netem qdisc (CONFIG_NET_SCH_NETEM), which this kernel lacks"
	if prio_works; then
		prio_band=1
	else
		prio_band=0
		echo "testbed: no htb qdisc or u32 filter in this kernel: small packets share the NICs' FIFO" >&2
	fi
	down # debris of an earlier run
	trap 'down' INT TERM
	ip link add "${prefix}-mgmt" type bridge
	ip addr add 10.78.0.254/24 dev "${prefix}-mgmt"
	ip link set "${prefix}-mgmt" up
	r=0
	while [ $r -lt "$rails" ]; do
		ip link add "${prefix}-r$r" type bridge
		ip link set "${prefix}-r$r" mtu "$mtu"
		ip link set "${prefix}-r$r" up
		r=$((r + 1))
	done
	n=0
	while [ $n -lt "$nodes" ]; do
		ns=$(ns_name $n)
		ip netns add "$ns"
		ip -n "$ns" link set lo up
		ip link add "${prefix}-${n}m" type veth peer name mgmt netns "$ns"
		ip link set "${prefix}-${n}m" master "${prefix}-mgmt" up
		ip -n "$ns" addr add "10.78.0.$((n + 1))/24" dev mgmt
		ip -n "$ns" link set mgmt up
		r=0
		while [ $r -lt "$rails" ]; do
			outer="${prefix}-${n}r$r"
			ip link add "$outer" type veth peer name "rail$r" netns "$ns"
			ip link set "$outer" mtu "$mtu"
			ip -n "$ns" link set "rail$r" mtu "$mtu"
			ip link set "$outer" master "${prefix}-r$r" up
			ip -n "$ns" addr add "10.77.$r.$((n + 1))/24" dev "rail$r"
			ip -n "$ns" link set "rail$r" up
			shape "rail$r" ip netns exec "$ns"
			shape "$outer"
			r=$((r + 1))
		done
		n=$((n + 1))
	done
	trap - INT TERM
	echo "testbed: up: $nodes nodes x $rails rails at ${mbit} Mbit/s per NIC, MTU $mtu (prefix $prefix)"
}

status() {
	ip netns list | grep "^${prefix}-n" || true
	ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^${prefix}-" || true
}

cmd=${1:-}; [ $# -gt 0 ] && shift
case "$cmd" in
up) parse_opts "$@"; up ;;
down) parse_opts "$@"; down ;;
status) parse_opts "$@"; status ;;
exec) node=$1; shift; exec ip netns exec "$(ns_name "$node")" "$@" ;;
*) sed -n '2,16p' "$0"; exit 2 ;;
esac
