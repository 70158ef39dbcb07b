#!/usr/bin/env python3
"""Benchmark (not a test; docs/perf/runs/multigpu.md): RailWave on a host with several GPUs, one rank per
GPU. Needs 2 or more GPUs; with fewer it says why and exits 77.

Two railwaved on loopback (tcp rails, R=2) stand for two nodes; node n sees its own GPUs through
CUDA_VISIBLE_DEVICES (GPUs n*G .. n*G+G-1 of the host, wrapping when the host has fewer than 2G),
and its G ranks (tools/rw_bench_rank --cuda: local rank g allocates on its node's device g, so
each rank's buffers sit on their own GPU) check every row, count and combined sum exactly. In the
same run, on the same ranks and bytes:
  * RailWave's CUDA mover and its staging path (the host mover: RAILWAVE_CUDA_MOVER=0), every
    path and the selector (rw_bench_rank --paths cycles them step by step), per phase kind: the
    median over the timed steps of last submission -> last completion;
  * PyTorch's all_to_all_single over NCCL, one process per GPU (world 2G), each rank sending the
    other half's ranks the bytes a RailWave rank sends the other node per phase (from the daemons'
    rail counters). NCCL moves them over NVLink inside the host: a ceiling for the intra-host
    part, not a like-for-like baseline (RailWave's bytes cross tcp loopback rails here, as they
    would cross NICs between real nodes);
  * the forward and combine kernels across GPUs against a plain peer copy of the same bytes
    ($b/cuda/bench_peer, tests/cuda/bench_peer.c).
NVLink multicast stays off in every process started here (NCCL_NVLS_ENABLE=0 and the rest of the
device notes' variables).

  python3 $b/bench/multigpu [--per-node G] [--shape deepseek] [--tokens 1024] [--steps 3]
                            [--modes cuda,staging] [--no-nccl] [--no-peer]"""
import argparse
import ctypes
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)

RANK = os.path.join(B, "tools", "rw_bench_rank")
PEER = os.path.join(B, "cuda", "bench_peer")
SHAPES = {"deepseek": (7168, 256, 8), "glm": (4096, 128, 8)}  # hidden, experts, top-k
PATHS = ["native", "rail-only", "perm-only", "joint", "auto"]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_count():
    """(GPUs this process sees, None) or (0, why not)."""
    try:
        cu = ctypes.CDLL(os.environ.get("RW_CUDA_DRIVER") or "libcuda.so.1")
    except OSError as e:
        return 0, "no CUDA driver (%s)" % e
    if cu.cuInit(0) != 0:
        return 0, "cuInit failed"
    n = ctypes.c_int(0)
    if cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0, "cuDeviceGetCount failed"
    return n.value, None


def node_gpus(n, per_node, ngpu):
    return [(n * per_node + g) % ngpu for g in range(per_node)]


def railwave(tmp, mode, a, ngpu):
    """One run of the two daemons and 2G ranks; per (kind, path) median ms, and per kind the bytes
    a node sends the other per phase."""
    hidden, experts, topk = SHAPES[a.shape]
    G = a.per_node
    rec = ((16 + topk * 8 + 15) & ~15) + ((hidden * 2 + 15) & ~15)
    crec = 16 + ((hidden * 2 + 15) & ~15)
    c = cluster.Cluster(tmp, 2, path="auto", gpus=G, extra={
        "recv_region_mib": 64 + 6 * G * a.tokens * rec // (1 << 20),
        "phase_timeout_ms": 60000, "heartbeat_timeout_ms": 10000})
    if mode == "staging":
        c.env["RAILWAVE_CUDA_MOVER"] = "0"
    for n in range(2):
        c.node_env[n] = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, node_gpus(n, G, ngpu)))}
    steps = len(PATHS) * (a.steps + 1)  # the first cycle warms up (imports, kernels, slabs)
    wl = ["--nodes", "2", "--gpus", str(G), "--rails", "2", "--experts", str(experts),
          "--topk", str(topk), "--hidden", str(hidden), "--tokens", str(a.tokens),
          "--seed", str(a.seed), "--paths", ",".join(PATHS)]
    c.start_all()
    try:
        procs = []
        for r in range(2 * G):
            n = r // G
            env = dict(c.env, **c.node_env[n])
            procs.append(subprocess.Popen(
                [RANK, "--socket", c.cfg["nodes"][n]["ipc_socket"], "--group", "mgpu",
                 "--rank", str(r), "--steps", str(steps), "--cuda"] + wl,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
        outs = [p.communicate(timeout=900)[0].decode() for p in procs]
        for r, p in enumerate(procs):
            if p.returncode != 0 or "(CUDA buffer)" not in outs[r]:
                why = [l for l in c.logs().splitlines() if "ERROR" in l or "faulted" in l]
                raise RuntimeError("rank %d rc %s: %s\n%s" % (r, p.returncode,
                                                             outs[r].strip()[-600:],
                                                             "\n".join(why[:6])))
        recs = [sum(int(r["tx_records"]) for r in c.rail_stats(n)) for n in range(2)]
        logs = [open(os.path.join(tmp, "d%d.log" % n)).read() for n in range(2)]
    finally:
        c.stop()
    if mode == "cuda":
        for n in range(2):
            for d in range(G):
                if "kernels loaded on device %d" % d not in logs[n]:
                    raise RuntimeError("daemon %d did not carry device %d's ranks with the CUDA "
                                       "mover" % (n, d))
    pairs = {}
    for out in outs:
        for line in out.splitlines():
            f = line.split()
            if f[:1] == ["pair"] and int(f[1]) >= len(PATHS):
                pairs.setdefault((int(f[1]), f[7]), []).append([int(x) for x in f[2:6]])
    ms = {}
    for (step, path), v in pairs.items():
        ms.setdefault(("dispatch", path), []).append((max(x[1] for x in v) - max(x[0] for x in v)) / 1e6)
        ms.setdefault(("combine", path), []).append((max(x[3] for x in v) - max(x[2] for x in v)) / 1e6)
    phases = 2 * steps
    per_phase = max(recs) // phases  # records one node sends the other per phase (each kind)
    return {k: statistics.median(v) for k, v in ms.items()}, {
        "dispatch": per_phase * rec, "combine": per_phase * crec}


def nccl(a, ngpu, sizes):
    """all_to_all_single over NCCL, one process per GPU (rank r on GPU r mod the host's): per
    kind, each rank sends bytes/G to every rank of the other half. Returns {kind: ms} (the
    slowest rank's median) or the reason it could not run."""
    G = a.per_node
    world = 2 * G
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    args = ["%s=%d" % (k, v // G) for k, v in sizes.items()]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--nccl-worker",
                               str(r), str(world), str(port), str(r % ngpu), str(a.steps)] + args,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=dict(os.environ, **NO_MULTICAST))
             for r in range(world)]
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    if any(p.returncode for p in procs):
        bad = [o for p, o in zip(procs, outs) if p.returncode][0]
        return "NCCL workers failed: %s" % bad.strip()[-600:]
    res = {}
    for line in outs[0].splitlines():
        f = line.split()
        if f[:1] == ["nccl"]:
            res[f[1]] = float(f[2])
    return res


def nccl_worker(argv):
    """One rank of nccl(): RANK WORLD PORT DEVICE STEPS KIND=BYTES_PER_PEER..."""
    import torch
    import torch.distributed as dist
    rank, world, port, dev, steps = (int(x) for x in argv[:5])
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world)
    half = world // 2
    for kv in argv[5:]:
        kind, per_peer = kv.split("=")
        per_peer = int(per_peer)
        splits = [per_peer if p // half != rank // half else 0 for p in range(world)]
        inp = torch.full((sum(splits),), rank, dtype=torch.uint8, device="cuda")
        out = torch.empty_like(inp)
        times = []
        for i in range(steps + 2):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.monotonic()
            dist.all_to_all_single(out, inp, splits, splits)
            torch.cuda.synchronize()
            if i >= 2:
                times.append((time.monotonic() - t0) * 1e3)
        # every byte from the right rank (exact, as the RailWave ranks check theirs)
        want = torch.cat([torch.full((sp,), p, dtype=torch.uint8, device="cuda")
                          for p, sp in enumerate(splits)])
        if not torch.equal(out, want):
            print("FAIL: rank %d %s: wrong bytes" % (rank, kind))
            return 1
        t = torch.tensor([statistics.median(times)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            print("nccl %s %.3f" % (kind, t.item()))
    dist.destroy_process_group()
    return 0


def main():
    if sys.argv[1:2] == ["--nccl-worker"]:
        return nccl_worker(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-node", type=int, default=0, help="ranks (GPUs) per node")
    ap.add_argument("--shape", default="deepseek", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per path")
    ap.add_argument("--modes", default="cuda,staging")
    ap.add_argument("--no-nccl", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--seed", type=int, default=12345)
    a = ap.parse_args()
    os.environ.update(NO_MULTICAST)
    ngpu, why = gpu_count()
    if ngpu < 2:
        print("skip: this benchmark needs 2 or more GPUs (one rank per GPU); %s"
              % (why or "%d visible" % ngpu))
        return 77
    a.per_node = a.per_node or min(4, max(1, ngpu // 2))
    G = a.per_node
    print("== %d GPUs; 2 railwaved (tcp loopback, R=2) x %d ranks, node n on GPUs %s; %s, %d "
          "tokens/rank, bf16; ms = last submission -> last completion, median of %d steps per "
          "path" % (ngpu, G, [node_gpus(n, G, ngpu) for n in range(2)], a.shape, a.tokens,
                    a.steps))
    got, sizes, failed = {}, None, 0
    for mode in a.modes.split(","):
        # A mode that fails (the CUDA mover without peer access between the GPUs: docs/cuda.md
        # "Several GPUs") is reported; the others still run.
        with tempfile.TemporaryDirectory(prefix="rwmgb.", dir="/tmp") as tmp:
            try:
                got[mode], sizes = railwave(tmp, mode, a, ngpu)
            except Exception as e:
                print("FAIL %s: %s" % (mode, e))
                failed = 1
    if sizes is None:
        return 1
    print("%-9s %-10s %-16s %9s %9s" % ("kind", "path", "mover", "MB/node", "ms"))
    for kind in ("dispatch", "combine"):
        for path in PATHS:
            for mode in got:
                print("%-9s %-10s %-16s %9.1f %9.2f" % (kind, path, mode, sizes[kind] / 1e6,
                                                       got[mode][(kind, path)]))
    if not a.no_nccl:
        res = nccl(a, ngpu, sizes)
        if isinstance(res, str):
            print("nccl: %s" % res)
        else:
            for kind in ("dispatch", "combine"):
                print("%-9s %-10s %-16s %9.1f %9.2f   (NVLink inside the host: a ceiling for the "
                      "intra-host part, not like for like)" % (kind, "a2a", "nccl", sizes[kind] / 1e6,
                                                               res[kind]))
    if not a.no_peer:
        sys.stdout.flush()
        p = subprocess.run([PEER], env=os.environ)
        failed |= p.returncode not in (0, 77)
    return failed


if __name__ == "__main__":
    sys.exit(main())
