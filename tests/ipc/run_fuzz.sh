#!/bin/sh
# Run the IPC fuzzer (built next to this script as ../fuzz/ipc_fuzz) briefly over its seed corpus.
# New inputs go to a temporary folder, so the committed corpus is never modified. Run from the
# repository root (tests/run does). Exit 0 pass, 77 skip, else fail (a crash, leak or invariant).
#   RW_FUZZ_SECONDS=N   run longer (default 15)
set -u
here=$(dirname "$0")
fuzzer=$here/../fuzz/ipc_fuzz
corpus=tests/ipc/corpus
[ -x "$fuzzer" ] || { echo "skip: $fuzzer not built"; exit 77; }
[ -d "$corpus" ] || { echo "skip: $corpus not found (run from the repository root)"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/new"
# Time-bounded so CI stays fast; -runs caps it on fast machines.
"$fuzzer" -max_total_time="${RW_FUZZ_SECONDS:-15}" -runs=200000 -max_len=2048 \
	-artifact_prefix="$work/" -print_final_stats=1 "$work/new" "$corpus" >"$work/log" 2>&1
rc=$?
tail -n 30 "$work/log"
for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
	[ -f "$f" ] && { echo "artifact $(basename "$f"):"; od -A d -t x1 "$f" | head -n 20; }
done
[ $rc -eq 0 ] || { echo "ipc_fuzz: FAILED (exit $rc)"; exit 1; }
echo "ipc_fuzz: ok"
