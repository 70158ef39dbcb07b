#!/bin/sh
# Run one libFuzzer target briefly over its seed corpus. The build copies this script to
# $b/test/<name>; the fuzzer is $b/fuzz/<name> and its corpus is picked by name below:
#   ipc_fuzz       tests/ipc/corpus     everything a client can send (ipc/)
#   parsers_fuzz   tests/fuzz/corpus    peer wire messages, rail headers, config, anchor tables
# New inputs go to a temporary folder, so the committed corpus is never modified. Run from the
# repository root (tests/run does). Exit 0 pass, 77 skip, else fail (a crash, leak or invariant).
#   RW_FUZZ_SECONDS=N   run longer (default 15)
set -u
here=$(dirname "$0")
name=$(basename "$0")
fuzzer=$here/../fuzz/$name
case $name in
ipc_fuzz) corpus=tests/ipc/corpus ;;
parsers_fuzz) corpus=tests/fuzz/corpus ;;
*) echo "run_fuzz.sh: unknown fuzzer '$name'"; exit 1 ;;
esac
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
[ $rc -eq 0 ] || { echo "$name: FAILED (exit $rc)"; exit 1; }
echo "$name: ok"
