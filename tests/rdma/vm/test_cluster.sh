#!/bin/sh
# Test (installed as $b/test/rdma_cluster): railwaved over real verbs, end to end - three qemu
# guests with two Soft-RoCE rails each, one daemon and two ranks per guest, every path, the
# verbs-specific load cases and the faults (tests/rdma/vm/cluster.py, docs/rdma-verbs.md).
# About 1-1.5 min on 2 cores under TCG; hard limit RW_VM_CLUSTER_LIMIT seconds (default 360), after
# which it fails. Exits 77 (skip) when qemu, busybox-static or the kernel package cannot be had,
# or when RW_TEST_NO_VM is set (a quicker local suite).
set -u
here=$(cd "$(dirname "$0")" && pwd)
b=$(dirname "$here")
root=$(cd "$b/.." && pwd)
[ -f "$root/tests/rdma/vm/cluster.py" ] || root=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null)
[ -f "$root/tests/rdma/vm/cluster.py" ] || { echo "rdma_cluster: SKIP: cannot find the source tree"; exit 77; }
if [ -n "${RW_TEST_NO_VM:-}" ]; then
	echo "rdma_cluster: SKIP: RW_TEST_NO_VM is set"
	exit 77
fi
command -v python3 >/dev/null || { echo "rdma_cluster: SKIP: python3 missing"; exit 77; }
limit=${RW_VM_CLUSTER_LIMIT:-360}
timeout -k 60 "$limit" python3 "$root/tests/rdma/vm/cluster.py" "$b"
rc=$?
[ $rc = 124 ] && echo "rdma_cluster: FAIL: not done within ${limit}s"
exit $rc
