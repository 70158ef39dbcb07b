#!/usr/bin/env python3
"""The rank path's benchmark (docs/perf/rankpath.md: bench/gpu_path --suite rank) runs, so that its
code does not rot between GPU sessions: one tiny run on the kernel stand-in (RW_BENCH_FAKE_CUDA:
tests/integration/libfakecuda_kern.so for the daemons and the ranks, no matmul loop, no MPS),
shape `tiny` (hidden 40, 64 experts, top-8), 1 and 5 tokens per rank, two steps a segment.

Every rank (tools/rw_bench_rank: --cuda for the CUDA mover, --rank-path --priority both for the
rank path) checks every received row, its metadata, every per-expert count and every combined
sum and exits non-zero on the first wrong one; the benchmark fails when a rank does or when one
did not say it verified its pairs on its mode's path. Asserted here: exit 0, and for each size
every cell printed (old alone and beside; new alone and beside at both stream priorities) with
its host time per call, and the targets' section. Then the same at 5 tokens with the rank
path's SM budgets crossed in (--sms 0,1,3: every launch of the ranks' kernels capped at 1 and 3
blocks, which the stand-in plays block by block): every rank verified every pair under each
budget, and every (priority, budget) cell printed. No timing is asserted.
Run by tests/run as $b/test/bench_rankpath; exits 0 pass, 1 fail, 77 skip."""
import os
import re
import subprocess
import sys

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

BENCH = os.path.join(B, "bench", "gpu_path")
RANK = os.path.join(B, "tools", "rw_bench_rank")
check = cluster.Checks()


def main():
    if not cluster.built(cluster.DAEMON, cluster.RAILWAVE, BENCH, RANK) or \
            not os.path.exists(cluster.FAKE_KERN):
        print("skip: railwaved, railwave, bench/gpu_path, rw_bench_rank or the kernel stand-in "
              "not built")
        return 77
    env = dict(os.environ, RW_BENCH_FAKE_CUDA=cluster.FAKE_KERN, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, BENCH, "--suite", "rank", "--shapes", "tiny", "--tokens",
                        "1,5", "--mps", "off", "--seed", str(cluster.test_seed())],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=600)
    out = p.stdout.decode()
    print(out)
    check(p.returncode == 0, "the benchmark ran every cell, each rank verified (exit %d)"
          % p.returncode)
    row = re.compile(r"^tiny +(\d+) (old|new) (alone|beside) +(\S+) +n=(\d+) +dispatch +[\d.]+ ms "
                     r"combine +[\d.]+ ms  host ns p50/p99 dispatch (\d+)/(\d+) combine "
                     r"(\d+)/(\d+)", re.M)
    cells = {(int(m[1]), m[2], m[3], m[4]): [int(x) for x in m.groups()[4:]]
             for m in row.finditer(out)}
    for tokens in (1, 5):
        want = [(tokens, "old", seg, "-") for seg in ("alone", "beside")] + \
            [(tokens, "new", seg, prio) for seg in ("alone", "beside") for prio in ("normal", "high")]
        check(all(w in cells for w in want), "T=%d: every cell printed (%s)"
              % (tokens, sorted(k for k in cells if k[0] == tokens)))
        check(all(cells[w][0] >= 1 and min(cells[w][1:]) > 0 for w in want if w in cells),
              "T=%d: every cell timed steps and measured the host time of its calls" % tokens)
    check("== targets" in out and re.search(r"^(met|MISSED) +tiny T=1 alone p50 <= 150 us", out,
                                            re.M) is not None, "the targets were checked")

    p = subprocess.run([sys.executable, BENCH, "--suite", "rank", "--shapes", "tiny", "--tokens",
                        "5", "--mps", "off", "--sms", "0,1,3", "--seed", str(cluster.test_seed())],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=600)
    out = p.stdout.decode()
    print(out)
    check(p.returncode == 0, "--sms 0,1,3: every cell ran, each rank verified every pair under "
          "each budget (exit %d)" % p.returncode)
    cells = {(int(m[1]), m[2], m[3], m[4]): [int(x) for x in m.groups()[4:]]
             for m in row.finditer(out)}
    want = [(5, "old", seg, "-") for seg in ("alone", "beside")] + \
        [(5, "new", seg, "%s,sms=%d" % (prio, n)) for seg in ("alone", "beside")
         for prio in ("normal", "high") for n in (0, 1, 3)]
    check(all(w in cells for w in want) and all(cells[w][0] >= 1 for w in want if w in cells),
          "--sms 0,1,3: every (priority, budget) cell printed and timed steps (%s)" % sorted(cells))
    check(re.search(r"^(met|MISSED) +tiny T=5 beside within 1.2x of alone \(high,sms=3 "
                    r"priority\)", out, re.M) is not None, "--sms 0,1,3: the targets per cell")
    return check.exit_code()


if __name__ == "__main__":
    sys.exit(main())
