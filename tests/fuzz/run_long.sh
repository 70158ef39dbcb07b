#!/bin/sh
# The long fuzzing run of docs/perf/fuzz.md: every parser of parsers_fuzz on its own (the first
# byte held with RW_FUZZ_PARSER) and ipc_fuzz, each for RUNS executions, one after the other, and
# one Markdown table row per target. Not part of the suite (hours of CPU); run from the
# repository root after `./configure && ninja`:
#   sh tests/fuzz/run_long.sh [RUNS] [TARGET...]     RUNS default 10000000
# TARGET: ipc, or a parser name below (default: all). Exit 1 if any target found something;
# its artifact is kept under the work folder printed first.
set -u
runs=${1:-10000000}
[ $# -gt 0 ] && shift
b=${RW_BUILD:-build}
all="ipc wire_hdr wire_hello wire_counts wire_phase_err wire_grant wire_heartbeat wire_regions
wire_records tcp config anchors"
targets=${*:-$all}
work=$(mktemp -d /tmp/rwfuzz.XXXXXX)
echo "work folder: $work (build $b, $runs executions per target)"
echo
echo "| target | executions | seconds | exec/s | new inputs | peak RSS MB | result |"
echo "|---|---:|---:|---:|---:|---:|---|"
bad=0
for t in $targets; do
	case $t in
	ipc) fuzzer=$b/fuzz/ipc_fuzz; corpus=tests/ipc/corpus; byte= ;;
	wire_hdr) byte=0x00 ;; wire_hello) byte=0x01 ;; wire_counts) byte=0x02 ;;
	wire_phase_err) byte=0x03 ;; wire_grant) byte=0x04 ;; wire_heartbeat) byte=0x05 ;;
	wire_regions) byte=0x06 ;; wire_records) byte=0x07 ;; tcp) byte=0x10 ;;
	config) byte=0x20 ;; anchors) byte=0x30 ;;
	*) echo "run_long.sh: unknown target '$t'" >&2; exit 2 ;;
	esac
	if [ "$t" != ipc ]; then
		fuzzer=$b/fuzz/parsers_fuzz
		corpus=tests/fuzz/corpus
	fi
	[ -x "$fuzzer" ] || { echo "run_long.sh: $fuzzer not built" >&2; exit 2; }
	mkdir -p "$work/$t/new"
	start=$(date +%s)
	RW_FUZZ_PARSER=$byte "$fuzzer" -runs="$runs" -max_len=2048 -print_final_stats=1 \
		-artifact_prefix="$work/$t/" "$work/$t/new" "$corpus" >"$work/$t/log" 2>&1
	rc=$?
	secs=$(( $(date +%s) - start ))
	stat() { sed -n "s/^stat::$1: *//p" "$work/$t/log" | tail -n 1; }
	result=ok
	if [ $rc -ne 0 ] || ls "$work/$t"/crash-* "$work/$t"/leak-* "$work/$t"/timeout-* \
		"$work/$t"/oom-* >/dev/null 2>&1; then
		result="FOUND (exit $rc, see $work/$t)"
		bad=1
	fi
	echo "| $t | $(stat number_of_executed_units) | $secs | $(stat average_exec_per_sec) |" \
		"$(stat new_units_added) | $(stat peak_rss_mb) | $result |"
done
exit $bad
