#!/bin/sh
# What a newcomer types first, for railwave and railwaved: -h/--help and --version exit 0 with
# the VERSION file's version; every subcommand's --help exits 0 and shows no literal '%%' (a
# printf format printed as text); demo/bench --help describe every option; a bad flag is one line
# naming it, exit 2, never the whole usage nor the config file's name.
set -u
b=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$b/.." && pwd)
tool="$b/tools/railwave"; daemon="$b/railwaved"
[ -x "$tool" ] && [ -x "$daemon" ] || { echo "SKIP: build railwave and railwaved first"; exit 77; }
export RAILWAVE_SRC="$src"
version=$(cat "$src/VERSION")
fail=0
no() { echo "FAIL: $*"; fail=1; }

for v in --version -V; do
	[ "$("$tool" $v)" = "railwave $version" ] || no "railwave $v"
	[ "$("$daemon" $v)" = "railwaved $version" ] || no "railwaved $v"
done
for h in -h --help; do
	"$tool" $h >/dev/null 2>&1 || no "railwave $h exit $?"
	"$daemon" $h | grep -q '^usage: railwaved' || no "railwaved $h"
done
cmds=$("$tool" help | sed -n 's/^  \([a-z-]*\) .*/\1/p')
[ -n "$cmds" ] || no "railwave help lists no commands"
for c in $cmds; do
	[ "$c" = help ] && continue
	out=$("$tool" "$c" --help 2>&1); rc=$?
	[ $rc = 0 ] || no "railwave $c --help: exit $rc"
	echo "$out" | grep -q 'usage' || no "railwave $c --help has no usage line"
	echo "$out" | grep -n '%%' && no "railwave $c --help prints a literal %%"
	[ "$("$tool" help "$c" 2>&1)" = "$out" ] || no "railwave help $c differs from $c --help"
done
if command -v python3 >/dev/null 2>&1; then
	for c in demo bench; do
		# argparse: an option line with nothing after the option (and no continuation line)
		# has no description.
		"$tool" $c --help | awk -v c=$c '
			/^  -/ { if (pending) { print "FAIL: railwave " c ": " pending " undescribed"; bad = 1 }
			         pending = ($0 ~ /^  -[^ ]*( [A-Z_]+)?(, -[^ ]*( [A-Z_]+)?)?$/) ? $1 : ""; next }
			/^                        / { pending = ""; next }
			{ if (pending) { print "FAIL: railwave " c ": " pending " undescribed"; bad = 1 } pending = "" }
			END { if (pending) { print "FAIL: railwave " c ": " pending " undescribed"; bad = 1 } exit bad }' || fail=1
	done
fi

check_bad() { # check_bad WANT_RC WANT_TEXT CMD...
	want_rc=$1 want=$2; shift 2
	out=$("$@" 2>&1); rc=$?
	[ $rc = "$want_rc" ] || no "$*: exit $rc, want $want_rc"
	echo "$out" | grep -qF -- "$want" || no "$*: '$out' lacks '$want'"
}
check_bad 2 "railwaved: unknown option --bogus (see --help)" "$daemon" --bogus
check_bad 2 "railwaved: --node needs a value (see --help)" "$daemon" --node
[ "$("$daemon" --bogus 2>&1 | wc -l)" = 1 ] || no "railwaved --bogus prints more than one line"
check_bad 2 "railwaved: configuration: --phase-timeout-ms: 'abc' is not a non-negative integer" \
	"$daemon" --config "$src/deploy/clusters/loopback-4x4.json" --node 0 --phase-timeout-ms abc
check_bad 2 "railwave wait: bad value for --timeout: 'soon'" "$tool" wait --timeout soon
check_bad 2 "expected 0 to 86400 seconds" "$tool" wait --timeout 1e9
check_bad 2 "railwave: unknown command 'nope'" "$tool" nope
[ $fail = 0 ] && echo "cli: ok"
exit $fail
