#!/usr/bin/env python3
"""The rank kernels' benchmark (cuda/bench_rank, docs/perf/rankpath.md "The kernels alone") runs,
so that its code does not rot between GPU sessions: a short run on the kernel stand-in
(tests/integration/libfakecuda_kern.so: the kernels played by cuda/rank_cpu.c on the CPU), both
shapes at 1 and 9 tokens per rank, two repetitions, the 128-byte stride variant on; then once
more with every launch capped at 2 blocks, once with the slabs in device memory
(--slabs gpu), and once with the kernels reading the page itself (--page host, which the
stand-in refuses unless RW_FAKE_RANK_HOST_READS=1 says it is meant). The benchmark checks each kernel's output byte for
byte against cuda/rank_cpu.c run on the same inputs and the device error word, and exits non-zero
on the first difference. Asserted here: exit 0; for every (shape, tokens) the phase's header
line, one line per kernel (pack, forward, gather, reduce) with its bytes, its time and both
ceilings' times, and the "verified" line. No timing is asserted (the stand-in's are the CPU's).
Run by tests/run as $b/test/bench_rank; exits 0 pass, 1 fail, 77 skip."""
import os
import re
import subprocess
import sys

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(B, "cuda", "bench_rank")
FAKE = os.path.join(B, "tests", "integration", "libfakecuda_kern.so")
NUM = r"(?:[\d.]+|-)"


def run(extra, env_add=None):
    env = dict(os.environ, RW_CUDA_DRIVER=FAKE, **(env_add or {}))
    p = subprocess.run([BENCH, "--shapes", "deepseek,glm", "--tokens", "1,9", "--reps", "2",
                        "--variant"] + extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       env=env, timeout=300)
    return p.returncode, p.stdout.decode()


def check_out(rc, out, what, gpu=False):
    fails = []
    if rc != 0:
        fails.append("%s: exit %d" % (what, rc))
    for shape in ("deepseek", "glm"):
        for t in (1, 9):
            head = r"^%s +T=%d +hidden \d+ bf16, \d+ experts, top-8, 2 nodes x 4 ranks: " \
                   r"records to nodes 0/1 \d+/\d+, forward rows \d+, reduce terms \d+; " \
                   r"rec_size \d+ \(mod 128 = \d+\)" % (shape, t)
            if not re.search(head, out, re.M):
                fails.append("%s: %s T=%d: no phase line" % (what, shape, t))
            for k, d in (("pack", "D2H"), ("forward", "H2D"), ("gather", "D2H"),
                         ("reduce", "H2D")):
                d = "D2D" if gpu else d
                line = r"^%s +T=%d +%s +%s +[\d.]+ MB +%s us +%s GB/s \| copy16 +%s us +%s GB/s " \
                       r"x[\d.]+ \| memcpy +%s us +%s GB/s x[\d.]+ \| copy16@128 " % \
                       (shape, t, k, d, NUM, NUM, NUM, NUM, NUM, NUM)
                if not re.search(line, out, re.M):
                    fails.append("%s: %s T=%d: no %s line" % (what, shape, t, k))
            if not re.search(r"^%s +T=%d +verified: pack forward gather reduce" % (shape, t),
                             out, re.M):
                fails.append("%s: %s T=%d: not verified" % (what, shape, t))
    return fails


def main():
    if not os.path.exists(BENCH) or not os.path.exists(FAKE):
        print("skip: cuda/bench_rank or the kernel stand-in not built")
        return 77
    fails = []
    rc, out = run([])
    print(out)
    if rc == 77:
        print("skip: the rank image is absent (built without nvcc)")
        return 77
    fails += check_out(rc, out, "default grids")
    rc, out = run(["--blocks", "2"])
    print(out)
    fails += check_out(rc, out, "2 blocks")  # every kernel verified under the cap
    rc, out = run(["--slabs", "gpu"])
    print(out)
    fails += check_out(rc, out, "slabs in device memory", gpu=True)
    # the kernels reading the page itself: the stand-in refuses that unless told
    rc, out = run(["--page", "host"], {"RW_FAKE_RANK_HOST_READS": "1"})
    print(out)
    fails += check_out(rc, out, "page in host memory")
    for f in fails:
        print("FAIL", f)
    print("bench_rank: %s" % ("FAIL" if fails else "ok"))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
