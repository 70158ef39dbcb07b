#!/bin/sh
# railvm: run one command in each of two small qemu guests joined by point-to-point rails, with a
# Soft-RoCE device (rxeR) per rail, to exercise real libibverbs/librdmacm traffic on a machine that
# has no RDMA NIC (see docs/rdma-verbs.md). Everything comes from Debian packages: the kernel is
# `apt-get download`ed once into a cache, busybox-static is init, host binaries run unchanged.
#
#   tests/rdma/vm/railvm.sh [-r RAILS] [-t SECS] [-o DIR] [-b HOSTBIN]... [-0 CMD] [-1 CMD]
#   tests/rdma/vm/railvm.sh -p          (only fetch and prepare the kernel cache)
#   tests/rdma/vm/railvm.sh -I DIR [-b HOSTBIN]...   (only build DIR/initrd.cpio and link
#             DIR/vmlinuz, for tests/rdma/vm/cluster.py, which starts the guests itself)
#
#   -b FILE   copy a host executable into the guests as /usr/bin/<name>, with its ldd closure
#   -0/-1 CMD shell command (busybox sh) for guest 0 / guest 1; it sees RW_NODE, RW_PEER,
#             RW_RAILS and, per rail R, RW_DEV_R (rxeR), RW_IP_R and RW_PEER_IP_R
#   -r RAILS  rails (NICs, rxe devices) per guest, 1..4 (default 2)
#   -t SECS   hard limit for the whole run (default 300); the guests are always killed
#   -o DIR    keep logs there (guestN.out: the command's output, guestN.console: kernel/init)
#   -I DIR    build the guests' initramfs and kernel link into DIR, start nothing
# Environment: RW_VM_CACHE (default ~/.cache/railwave-vm), RW_VM_ACCEL (tcg | kvm; default tcg),
#   RW_VM_CPU (qemu -cpu; default max,-erms,-fsrm),
#   RW_VM_KERNEL_PKG (e.g. linux-image-6.1.0-57-amd64; default: what linux-image-amd64 depends on).
# Exit status: 0 when both commands exit 0; 77 when qemu, busybox or the kernel cannot be had
# (skip); 1 otherwise. Each guest's output is printed with a "[gN] " prefix.
set -u

here=$(cd "$(dirname "$0")" && pwd)
rails=2 limit=300 keep= bins= cmd0=true cmd1=true prepare_only= image_only=
while getopts r:t:o:b:0:1:I:ph opt; do
	case $opt in
	r) rails=$OPTARG ;;
	t) limit=$OPTARG ;;
	o) keep=$OPTARG ;;
	b) bins="$bins $OPTARG" ;;
	0) cmd0=$OPTARG ;;
	1) cmd1=$OPTARG ;;
	p) prepare_only=1 ;;
	I) image_only=$OPTARG ;;
	*) sed -n '2,25s/^# \{0,1\}//p' "$0"; exit 2 ;;
	esac
done
case $rails in [1-4]) ;; *) echo "railvm: -r wants 1..4" >&2; exit 2 ;; esac

skip() { echo "railvm: SKIP: $*"; exit 77; }
log() { echo "railvm: $*" >&2; }

cache=${RW_VM_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/railwave-vm}
modules_wanted="crc32_generic virtio_pci virtio_net rdma_rxe rdma_ucm ib_uverbs"

# --- kernel: vmlinuz + the modules we need, depmod'ed and ordered, cached per version -------
kernel_pkg() {
	if [ -n "${RW_VM_KERNEL_PKG:-}" ]; then echo "$RW_VM_KERNEL_PKG"; return; fi
	apt-cache depends linux-image-amd64 2>/dev/null |
		sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-amd64\)$/\1/p' | head -n 1
}

prepare_kernel() {
	pkg=$(kernel_pkg)
	if [ -z "$pkg" ]; then
		# No apt metadata: use the newest kernel already in the cache, if any.
		kdir=$(ls -d "$cache"/*/ready 2>/dev/null | sort | tail -n 1)
		[ -n "$kdir" ] || skip "cannot resolve linux-image-amd64 (apt-get update?) and no cached kernel in $cache"
		kdir=$(dirname "$kdir")
		return 0
	fi
	kver=${pkg#linux-image-}
	kdir=$cache/$kver
	[ -f "$kdir/ready" ] && return 0
	command -v dpkg-deb >/dev/null && command -v depmod >/dev/null && command -v modprobe >/dev/null ||
		skip "dpkg-deb/depmod/modprobe missing (apt-get install dpkg kmod)"
	mkdir -p "$cache" || skip "cannot create cache $cache"
	tmp=$(mktemp -d "$cache/.prep.XXXXXX") || skip "cannot write to $cache"
	log "fetching $pkg into $cache (once)"
	# _apt cannot write into root's private temp dirs; let it, or apt warns and downloads as root.
	chmod 777 "$tmp" 2>/dev/null
	if ! (cd "$tmp" && apt-get download "$pkg" >/dev/null 2>&1); then
		if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null 2>&1; fi
		(cd "$tmp" && apt-get download "$pkg" >/dev/null 2>&1) ||
			{ rm -rf "$tmp"; skip "apt-get download $pkg failed (no network or stale apt lists)"; }
	fi
	dpkg-deb -x "$tmp"/linux-image-*.deb "$tmp/x" || { rm -rf "$tmp"; skip "cannot unpack $pkg"; }
	# The package ships no modules.dep: build it, then ask modprobe for the load order.
	depmod -b "$tmp/x" "$kver" || { rm -rf "$tmp"; skip "depmod failed for $kver"; }
	mkdir -p "$tmp/k/modules"
	cp "$tmp/x/boot/vmlinuz-$kver" "$tmp/k/vmlinuz" || { rm -rf "$tmp"; skip "no vmlinuz in $pkg"; }
	: >"$tmp/k/modules/order"
	for m in $modules_wanted; do
		modprobe -d "$tmp/x" -S "$kver" --show-depends "$m" >>"$tmp/deps" ||
			{ rm -rf "$tmp"; skip "module $m not in $pkg"; }
	done
	# "insmod /path/x.ko [params]" lines; builtins print "builtin x". Keep first occurrence.
	for ko in $(awk '$1 == "insmod" && !seen[$2]++ { print $2 }' "$tmp/deps"); do
		cp "$ko" "$tmp/k/modules/" && basename "$ko" >>"$tmp/k/modules/order"
	done
	echo "$pkg" >"$tmp/k/package"
	touch "$tmp/k/ready"
	# Publish atomically; a concurrent run that won the race leaves its copy in place.
	mv "$tmp/k" "$kdir" 2>/dev/null || [ -f "$kdir/ready" ] || { rm -rf "$tmp"; skip "cannot publish $kdir"; }
	rm -rf "$tmp"
	[ -f "$kdir/ready" ] || skip "kernel cache $kdir incomplete"
}

command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 missing (apt-get install qemu-system-x86)"
busybox=
for p in /bin/busybox /usr/bin/busybox; do
	[ -x "$p" ] && file -L "$p" 2>/dev/null | grep -q 'statically linked' && busybox=$p && break
	[ -x "$p" ] && ! ldd "$p" >/dev/null 2>&1 && busybox=$p && break
done
[ -n "$busybox" ] || skip "busybox-static missing (apt-get install busybox-static)"
command -v cpio >/dev/null || skip "cpio missing"
rdma_tool=$(command -v rdma) || skip "rdma tool missing (apt-get install iproute2)"
provider=
for d in /usr/lib/x86_64-linux-gnu/libibverbs /usr/lib64/libibverbs /usr/lib/libibverbs; do
	[ -f "$d/librxe-rdmav34.so" ] && provider=$d/librxe-rdmav34.so && break
done
[ -n "$provider" ] || provider=$(ls /usr/lib/*/libibverbs/librxe-rdmav*.so 2>/dev/null | head -n 1)
[ -n "$provider" ] || skip "Soft-RoCE provider librxe missing (apt-get install ibverbs-providers)"

prepare_kernel
[ -n "$prepare_only" ] && { echo "railvm: kernel ready in $kdir"; exit 0; }

# --- initramfs -------------------------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/railvm.XXXXXX") || exit 1
pids=
cleanup() {
	for p in $pids; do kill -TERM "$p" 2>/dev/null; done
	for f in "$work"/qemu*.pid; do
		[ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null
	done
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

root=$work/root
mkdir -p "$root/usr/bin" "$root/usr/sbin" "$root/usr/lib/modules/railvm" "$root/usr/lib64" \
	"$root/etc/libibverbs.d" "$root/proc" "$root/sys" "$root/dev" "$root/tmp"
for d in bin sbin lib lib64; do ln -s "usr/$d" "$root/$d"; done
cp "$busybox" "$root/usr/bin/busybox" && ln -s busybox "$root/usr/bin/sh"
cp "$here/guest-init" "$root/init" && chmod 755 "$root/init"
cp "$here/guest-agent" "$root/usr/bin/rwvm-agent" && chmod 755 "$root/usr/bin/rwvm-agent"
cp "$kdir"/modules/*.ko "$kdir/modules/order" "$root/usr/lib/modules/railvm/"

# copy FILE to DEST in the guest plus every shared library ldd names (same paths as the host).
add_elf() {
	mkdir -p "$root$(dirname "$2")"
	cp -L "$1" "$root$2" || return 1
	ldd "$1" 2>/dev/null | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i }' |
		while read -r lib; do
			[ -e "$root$lib" ] && continue
			mkdir -p "$root$(dirname "$lib")" && cp -L "$lib" "$root$lib"
		done
}
add_elf "$rdma_tool" /usr/bin/rdma || exit 1
add_elf "$provider" "$provider" || exit 1
echo "driver rxe" >"$root/etc/libibverbs.d/rxe.driver"
# pthread_exit/cancellation dlopen libgcc_s; ldd does not list it.
gcc_s=$(ldconfig -p 2>/dev/null | awk '/libgcc_s.so.1 .*x86-64/ { print $NF; exit }')
[ -n "$gcc_s" ] && add_elf "$gcc_s" "$gcc_s"
for b in $bins; do
	[ -f "$b" ] || { log "no such file: $b"; exit 1; }
	add_elf "$b" "/usr/bin/$(basename "$b")" || { log "cannot copy $b"; exit 1; }
done
printf '%s\n' "$cmd0" >"$root/cmd0"
printf '%s\n' "$cmd1" >"$root/cmd1"
(cd "$root" && find . | cpio -o -H newc --quiet) >"$work/initrd.cpio" || { log "cpio failed"; exit 1; }
if [ -n "$image_only" ]; then
	mkdir -p "$image_only" && mv "$work/initrd.cpio" "$image_only/initrd.cpio" &&
		ln -sf "$kdir/vmlinuz" "$image_only/vmlinuz" && cp "$kdir/package" "$image_only/package" ||
		{ log "cannot write $image_only"; exit 1; }
	exit 0
fi

# --- rails: one UDP point-to-point link per rail, on loopback ports the kernel picks ----------
nports=$((2 * rails))
ports=$(python3 -c '
import socket, sys
s = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(int(sys.argv[1]))]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))' "$nports" 2>/dev/null) ||
	ports=$(awk -v n="$nports" 'BEGIN { srand(); b = 20000 + int(rand() * 20000) * 2; for (i = 0; i < n; i++) printf "%d ", b + i }')
port() { echo "$ports" | awk -v i="$1" '{ print $(i + 1) }'; } # port(rail * 2 + node)

# Without ERMS/FSRM the guest kernel copies with mov loops instead of `rep movsb`, which TCG
# emulates one iteration (byte) at a time; rxe copies every payload twice (~30% less time).
cpu=${RW_VM_CPU:-max,-erms,-fsrm}
case ${RW_VM_ACCEL:-tcg} in
kvm) accel="-accel kvm -accel tcg" ;;
*) accel="-accel tcg,thread=multi" ;;
esac

start=$(date +%s)
for n in 0 1; do
	peer=$((1 - n))
	net=
	r=0
	while [ $r -lt "$rails" ]; do
		net="$net -netdev socket,id=rail$r,udp=127.0.0.1:$(port $((r * 2 + peer))),localaddr=127.0.0.1:$(port $((r * 2 + n)))"
		net="$net -device virtio-net-pci,netdev=rail$r,mac=52:54:00:00:0$r:0$n,romfile="
		r=$((r + 1))
	done
	# shellcheck disable=SC2086
	timeout -k 5 "$limit" qemu-system-x86_64 $accel -cpu "$cpu" -smp 2 -m 1024 -nodefaults -no-user-config \
		-display none -no-reboot -pidfile "$work/qemu$n.pid" \
		-kernel "$kdir/vmlinuz" -initrd "$work/initrd.cpio" \
		-append "console=ttyS0 quiet panic=-1 no_timer_check rwnode=$n rwrails=$rails" \
		-serial "file:$work/guest$n.console" -serial "file:$work/guest$n.out" \
		$net >"$work/qemu$n.log" 2>&1 &
	pids="$pids $!"
done

# Wait for both guests. When one has finished with a failure, give the other a short grace
# period (it is probably waiting for a peer that is gone) and then stop it.
status_of() { tr -d '\r' 2>/dev/null <"$work/guest$1.out" | sed -n 's/^@@RWVM-EXIT \([0-9]*\)$/\1/p' | tail -n 1; }
grace=
while :; do
	alive=0
	for p in $pids; do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
	[ $alive = 0 ] && break
	if [ -z "$grace" ]; then
		for n in 0 1; do
			s=$(status_of $n)
			[ -n "$s" ] && [ "$s" != 0 ] && grace=$(($(date +%s) + 20))
		done
	elif [ "$(date +%s)" -ge "$grace" ]; then
		log "a guest failed; stopping the other"
		for p in $pids; do kill -TERM "$p" 2>/dev/null; done
	fi
	sleep 1
done
wait
elapsed=$(($(date +%s) - start))

rc=0
for n in 0 1; do
	tr -d '\r' 2>/dev/null <"$work/guest$n.out" | grep -v '^@@RWVM-' | sed "s/^/[g$n] /"
	s=$(status_of $n)
	if [ -z "$s" ]; then
		echo "railvm: guest $n gave no exit status (timeout after ${limit}s, crash, or qemu failure)"
		sed "s/^/[g$n qemu] /" "$work/qemu$n.log"
		tr -d '\r' 2>/dev/null <"$work/guest$n.console" | tail -n 30 | sed "s/^/[g$n console] /"
		rc=1
	elif [ "$s" != 0 ]; then
		echo "railvm: guest $n command exited $s"
		tr -d '\r' 2>/dev/null <"$work/guest$n.console" | tail -n 15 | sed "s/^/[g$n console] /"
		rc=1
	fi
done
echo "railvm: $(cat "$kdir/package"), $rails rails, ${RW_VM_ACCEL:-tcg}, ${elapsed}s, status $rc"
if [ -n "$keep" ]; then
	mkdir -p "$keep" && cp "$work"/guest*.out "$work"/guest*.console "$work"/qemu*.log "$keep/" 2>/dev/null
fi
exit $rc
