#!/bin/sh
# Test (installed as $b/test/rdma_softroce): the verbs transport for real, i.e. the rail
# conformance suite between two Soft-RoCE qemu guests on two rails (tests/rdma/vm/softroce.sh).
# About 40 s (release) to 65 s (ASan) on 2 cores; the first run also fetches Debian's
# kernel package once into ~/.cache/railwave-vm. Exits 77 (skip) when qemu, busybox-static or
# the kernel package cannot be had, or when RW_TEST_NO_VM is set (a quicker local suite).
set -u
here=$(cd "$(dirname "$0")" && pwd)
b=$(dirname "$here")
root=$(cd "$b/.." && pwd)
[ -f "$root/tests/rdma/vm/softroce.sh" ] || root=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null)
[ -f "$root/tests/rdma/vm/softroce.sh" ] || { echo "rdma_softroce: SKIP: cannot find the source tree"; exit 77; }
if [ -n "${RW_TEST_NO_VM:-}" ]; then
	echo "rdma_softroce: SKIP: RW_TEST_NO_VM is set"
	exit 77
fi
exec sh "$root/tests/rdma/vm/softroce.sh" "$b"
