#!/usr/bin/env python3
"""A few training steps of a MoE layer (router + experts as torch.nn modules, railwave.MoE) whose
experts are spread over the ranks of a RailWave group, and the same model trained in one process
(--reference) for comparison. See docs/python.md "Example".

Each rank trains on its own tokens (seeded by rank); the loss of a step is Σ over ranks of the
mean squared error against a fixed target map. Expert gradients come back through RailWave
(combine's backward dispatches the output gradient, dispatch's backward combines the input
gradient). The router is replicated: under torchrun (MASTER_ADDR set) its gradient is summed
over ranks with torch.distributed (gloo), so every replica stays equal and the run computes
exactly what --reference computes; without torchrun the router stays frozen (expert-only
training: the dispatch runs without autograd, only combine's backward carries gradients) and
each rank prints its share of the loss, whose sum over ranks is what --reference
--freeze-router prints.

On the loopback cluster of deploy/clusters/loopback-2x2-one-ip.json (2 nodes × 2 ranks), with
the environment torchrun would set (Debian 12's torchrun 1.13 fails under Python 3.11 before
starting any worker — "'NoneType' object has no attribute 'get'" — so the loop sets it):
  build/railwaved --config deploy/clusters/loopback-2x2-one-ip.json --node 0 &
  build/railwaved --config deploy/clusters/loopback-2x2-one-ip.json --node 1 &
  for r in 0 1 2 3; do s=$([ $r -lt 2 ] && echo a || echo b)
    RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \\
    MASTER_PORT=29511 RAILWAVE_SOCKET=/run/railwave/$s.sock PYTHONPATH=python \\
    python3 examples/moe_train.py & done; wait
  PYTHONPATH=python python3 examples/moe_train.py --reference --world 4
Both print one line per step with the same losses (docs/python.md shows a run). With a working
torchrun: one `torchrun --nnodes 2 --node_rank N --nproc_per_node 2 --master_addr ...` per node,
RAILWAVE_SOCKET set to that node's socket."""
import argparse
import os
import sys

import torch
from torch import nn

HIDDEN, FFN, EXPERTS_PER_RANK, TOPK, TOKENS = 32, 64, 2, 2, 64


DEVICE = torch.device("cpu")


def data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(DEVICE)


def target_map():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5).to(DEVICE)


def init_params(world):
    """Router and every expert's weights, the same in every process."""
    g = torch.Generator().manual_seed(42)
    E = world * EXPERTS_PER_RANK
    router = torch.randn(E, HIDDEN, generator=g) * 0.1
    experts = [(torch.randn(FFN, HIDDEN, generator=g) / HIDDEN ** 0.5,
                torch.randn(HIDDEN, FFN, generator=g) / FFN ** 0.5) for _ in range(E)]
    return router, experts


class LocalGroup:
    """--reference: a stand-in 'group' of one rank that hosts every expert; dispatch and combine
    are the identity on rows (every token's experts are local), so railwave.MoE runs unchanged."""

    def __init__(self):
        self.rank, self.world_size = 0, 1

    def dispatch(self, x, idx, w, E, layer=0, step=None):
        return x, idx, w, None, None

    def combine(self, y, handle):
        return y


def build(group, world, freeze_router):
    from railwave.moe import MoE
    moe = MoE(group, HIDDEN, FFN, world * EXPERTS_PER_RANK, TOPK, layer=0)
    router, experts = init_params(world)
    with torch.no_grad():
        moe.router.weight.copy_(router)
        for i, ex in enumerate(moe.experts):
            a, b = experts[moe.first + i]
            ex.w1.weight.copy_(a)
            ex.w2.weight.copy_(b)
    moe.router.weight.requires_grad_(not freeze_router)
    return moe.to(DEVICE)


def reference(world, steps, lr, freeze_router):
    moe = build(LocalGroup(), world, freeze_router)
    tmap = target_map()
    opt = torch.optim.SGD([p for p in moe.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(moe(data(r, step)), data(r, step) @ tmap)
                   for r in range(world))
        loss.backward()
        opt.step()
        print("step %d loss %.6f" % (step, loss.item()), flush=True)


def distributed(steps, lr):
    import railwave
    dist = None
    if os.environ.get("MASTER_ADDR") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    # Every rank dispatches TOKENS tokens a step: the receive room is world × that.
    with railwave.Group.from_env(os.environ.get("RAILWAVE_GROUP", "moe_train"),
                                 max_tokens_per_rank=TOKENS) as group:
        world, rank = group.world_size, group.rank
        moe = build(group, world, freeze_router=dist is None)
        tmap = target_map()
        opt = torch.optim.SGD([p for p in moe.parameters() if p.requires_grad], lr=lr)
        for step in range(steps):
            opt.zero_grad()
            x = data(rank, step)
            loss = nn.functional.mse_loss(moe(x, step=step), x @ tmap)
            loss.backward()
            total = loss.detach().clone()
            if dist is not None:
                dist.all_reduce(moe.router.weight.grad)  # replicated router: Σ over ranks
                dist.all_reduce(total)
            opt.step()
            if dist is not None and rank == 0:
                print("step %d loss %.6f" % (step, total.item()), flush=True)
            elif dist is None:  # no all-reduce: each rank its own share of the loss
                print("step %d loss %.6f (rank %d's share; router frozen)"
                      % (step, total.item(), rank), flush=True)
    if dist is not None:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", action="store_true", help="train in this one process")
    ap.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                    help="ranks to emulate with --reference")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--freeze-router", action="store_true",
                    help="with --reference: as a run without torchrun does")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (rank r on GPU LOCAL_RANK)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    global DEVICE
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    if a.reference:
        reference(a.world, a.steps, a.lr, a.freeze_router)
    else:
        distributed(a.steps, a.lr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
