#!/usr/bin/env python3
"""Megatron-Core and TorchTitan MoE layers through RailWave on a GPU machine, against a
one-process reference (docs/perf/frameworks.md has the runs; tests/python/frameworks_gpu.sh
starts the daemons and the ranks):

  megatron RANK DIR   Megatron-Core's MoELayer, flex token dispatcher with the deepep backend
                      (deep_ep resolved to railwave.deep_ep by the shim distribution on
                      PYTHONPATH), EP = WORLD_SIZE ranks in a gloo group (4 ranks share the one
                      GPU: NCCL refuses that); forward + backward of one bf16 batch per rank;
                      writes DIR/megatron.RANK.pt
  megatron-ref DIR    the same layer in one process, EP = 1, alltoall dispatcher, every rank's
                      batch; compares output, input gradient, router and expert gradients
  titan RANK DIR      TorchTitan's MoE with railwave.torchtitan.railwave_dispatcher applied by
                      TorchTitan's override mechanism, expert_alignment 16; a few SGD steps;
                      then selective activation checkpointing with and without RailWave's
                      save list (dispatches counted); writes DIR/titan.RANK.pt
  titan-ref DIR       the same model in one process (TorchTitan's local dispatcher, all experts,
                      every rank's batch); compares the losses step by step
Weights and data are functions of (seed, global expert id / rank), so both sides build the same
model whatever the expert placement. Exits non-zero on a mismatch."""
import os
import zlib
import sys
import time

import torch
import torch.distributed as dist

SEED = 7
H, F, E, K = 64, 96, 8, 2          # Megatron: hidden, expert FFN, experts, top-k
S, B = 24, 2                       # tokens per rank = S * B
STEPS, LR = 4, 0.05                # TorchTitan: SGD steps, learning rate
BF16_TOL = 2 ** -5                 # max |got - want| / (max |want| + 1e-6), bf16 end to end


def gen(*key):
    return torch.Generator().manual_seed(SEED * 1000003 + zlib.crc32(repr(key).encode()))


def init_dist(rank, world, d, tag):
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method="file://%s/store.%s" % (d, tag), rank=rank,
                            world_size=world)


def worst(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / (b.abs().max() + 1e-6)) if b.numel() else 0.0


# ---- Megatron-Core -----------------------------------------------------------------------
def megatron_layer(ep, dispatcher):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(SEED)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=F, moe_ffn_hidden_size=F,
        num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
        moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend="deepep",
        moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        bf16=True, params_dtype=torch.bfloat16, add_bias_linear=False, gated_linear_unit=False,
        use_cpu_initialization=True)
    layer = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(
        config=cfg).cuda()
    el = E // ep
    first = ps.get_expert_model_parallel_rank() * el
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(E, H, generator=gen("router")) * 0.3)
        for i, ex in enumerate(layer.experts.local_experts):
            g = gen("expert", first + i)
            ex.linear_fc1.weight.copy_(torch.randn(F, H, generator=g) * H ** -0.5)
            ex.linear_fc2.weight.copy_(torch.randn(H, F, generator=g) * F ** -0.5)
    return layer, first


def megatron_batch(r):
    g = gen("batch", r)
    return torch.randn(S, B, H, generator=g).bfloat16(), torch.randn(S, B, H, generator=g).bfloat16()


def megatron_step(layer, x0, gout):
    x = x0.cuda().requires_grad_()
    out, _ = layer(x)
    out.backward(gout.cuda())
    return out.detach().cpu(), x.grad.cpu()


def expert_grads(layer, first):
    return {first + i: (ex.linear_fc1.weight.grad.float().cpu(),
                        ex.linear_fc2.weight.grad.float().cpu())
            for i, ex in enumerate(layer.experts.local_experts)}


def cmd_megatron(rank, d):
    world = int(os.environ["WORLD_SIZE"])
    init_dist(rank, world, d, "megatron")
    import deep_ep
    import megatron.core
    from megatron.core.transformer.moe import fused_a2a
    assert fused_a2a.Buffer is deep_ep.Buffer and getattr(deep_ep, "RAILWAVE", False), \
        "Megatron-Core's deep_ep is not railwave's"
    layer, first = megatron_layer(world, "flex")
    assert type(layer.token_dispatcher).__name__ == "MoEFlexTokenDispatcher"
    x, gout = megatron_batch(rank)
    megatron_step(layer, x, gout)  # warm-up (joins, registrations), then the measured step
    layer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out, gx = megatron_step(layer, x, gout)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    torch.save({"out": out, "gx": gx, "grouter": layer.router.weight.grad.float().cpu(),
                "experts": expert_grads(layer, first), "ms": dt * 1e3,
                "version": megatron.core.__version__}, "%s/megatron.%d.pt" % (d, rank))
    print("megatron rank %d: fwd+bwd %.1f ms (megatron-core %s, deep_ep = %s)"
          % (rank, dt * 1e3, megatron.core.__version__, deep_ep.__file__))


def cmd_megatron_ref(d):
    world = int(os.environ.get("REF_WORLD", "4"))
    init_dist(0, 1, d, "megatron-ref")
    layer, _ = megatron_layer(1, "alltoall")
    bad = []
    for r in range(world):
        got = torch.load("%s/megatron.%d.pt" % (d, r))
        x, gout = megatron_batch(r)
        out, gx = megatron_step(layer, x, gout)
        for name, a, b in (("output", got["out"], out), ("grad x", got["gx"], gx)):
            e = worst(a, b)
            print("megatron rank %d %-8s worst relative error %.2e" % (r, name, e))
            if e > BF16_TOL:
                bad.append("rank %d %s" % (r, name))
    grouter = sum(torch.load("%s/megatron.%d.pt" % (d, r))["grouter"] for r in range(world))
    e = worst(grouter, layer.router.weight.grad)
    print("megatron router grad (summed over ranks) worst relative error %.2e" % e)
    if e > BF16_TOL:
        bad.append("router grad")
    ref = expert_grads(layer, 0)
    errs = []
    for r in range(world):
        for gid, (g1, g2) in torch.load("%s/megatron.%d.pt" % (d, r))["experts"].items():
            errs.append(max(worst(g1, ref[gid][0]), worst(g2, ref[gid][1])))
    print("megatron expert grads (%d experts) worst relative error %.2e" % (len(errs),
                                                                           max(errs)))
    if max(errs) > BF16_TOL or len(errs) != E:
        bad.append("expert grads")
    print("megatron: %s (tolerance %.2e)" % ("EQUAL within bf16" if not bad else
                                            "MISMATCH " + ", ".join(bad), BF16_TOL))
    return 1 if bad else 0


# ---- TorchTitan ----------------------------------------------------------------------------
def titan_moe(ep, override):
    from torchtitan.models.common.config_utils import (make_moe_config, make_router_config,
                                                       make_routed_experts_config)
    moe_cfg = make_moe_config(
        num_experts=E, load_balance_coeff=None,
        router=make_router_config(dim=H, num_experts=E, gate_param_init={}, top_k=K,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=H, hidden_dim=F, num_experts=E, top_k=K,
                                                  param_init={}, comm_backend="standard"))
    replaced = []
    if override:
        from torchtitan.config.override import OverrideConfig, apply_overrides
        replaced = apply_overrides(OverrideConfig(imports=[(
            "railwave.torchtitan.railwave_dispatcher", {"expert_alignment": 16})]), moe_cfg)
        moe_cfg.routed_experts.inner_experts.num_experts = E // ep
    moe = moe_cfg.build().cuda()
    el = E // ep
    first = (dist.get_rank() if ep > 1 else 0) * el
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.randn(E, H, generator=gen("titan-router")) * 0.3)
        inner = moe.routed_experts.inner_experts
        for i in range(el):
            g = gen("titan-expert", first + i)
            inner.w1_EFD[i].copy_(torch.randn(F, H, generator=g) * H ** -0.5)
            inner.w2_EDF[i].copy_(torch.randn(H, F, generator=g) * F ** -0.5)
            inner.w3_EFD[i].copy_(torch.randn(F, H, generator=g) * H ** -0.5)
    return moe, replaced


def titan_batch(r, step):
    g = gen("titan-batch", r, step)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def titan_loss(moe, r, step):
    x, target = titan_batch(r, step)
    out = moe(x.cuda())
    return ((out.float() - target.cuda()) ** 2).mean()


def sgd(params):
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= LR * p.grad
                p.grad = None


def cmd_titan(rank, d):
    world = int(os.environ["WORLD_SIZE"])
    init_dist(rank, world, d, "titan")
    from torch.distributed.device_mesh import DeviceMesh

    from railwave import ops, torchtitan as rwtt
    moe, replaced = titan_moe(world, override=True)
    disp = moe.routed_experts.token_dispatcher
    assert isinstance(disp, rwtt.RailWaveTokenDispatcher), type(disp)
    disp.wire_meshes(ep_mesh=DeviceMesh("cpu", list(range(world))))
    static = os.environ.get("RAILWAVE_STATIC") == "1"  # the sync-free dispatcher
    group = ops._buffer().railwave_group
    losses, times = [], []
    for step in range(STEPS):
        t0 = time.perf_counter()
        loss = titan_loss(moe, rank, step)
        loss.backward()
        torch.cuda.synchronize()
        group.check()  # static: the host-visible call that raises what failed
        if static and (group._rank is None or not group._rank.static):
            raise AssertionError("RAILWAVE_STATIC=1 but the dispatcher's group is not on the "
                                 "static rank path (%s)" % (group.path(),))
        times.append(time.perf_counter() - t0)
        g = moe.router.gate.weight.grad.cpu()
        dist.all_reduce(g)  # the replicated router: Σ over ranks, as data parallelism does
        moe.router.gate.weight.grad.copy_(g)
        total = loss.detach().cpu().reshape(1)
        dist.all_reduce(total)
        losses.append(float(total))
        sgd(moe.parameters())
    out_file = "%s/titan.%d.pt" % (d, rank)
    torch.save({"losses": losses, "ms": [t * 1e3 for t in times], "sac": {},
                "replaced": replaced}, out_file)  # again below, with the SAC counts
    print("titan rank %d%s: losses %s; step ms %s; %s" % (
        rank, " (static: sync-free dispatcher, %d rows a layer's experts take)"
        % ops._buffer().static_capacity() if static else "", ["%.6f" % v for v in losses],
        ["%.1f" % (t * 1e3) for t in times], replaced[:1]), flush=True)
    # Selective AC: with RailWave's save list the backward dispatches no forward again; with
    # TorchTitan's default list alone (no railwave ops in it) it recomputes them (a second
    # pair, opened before the backward pair: ops.py _combine_backward). Same gradients.
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)
    from torchtitan.distributed.activation_checkpoint import _get_default_save_ops
    buf = ops._buffer()
    counts, grads = {}, {}
    for name, save in (("titan default list", _get_default_save_ops()),
                       ("with railwave_selective_ac", set(_get_default_save_ops()) |
                        set(ops.save_list()))):
        def policy(ctx, func, *args, **kw):
            return CheckpointPolicy.MUST_SAVE if func in save else \
                CheckpointPolicy.PREFER_RECOMPUTE
        x, target = titan_batch(rank, 99)
        before = buf._shared.step
        out = checkpoint(moe, x.cuda(), use_reentrant=False,
                         context_fn=lambda: create_selective_checkpoint_contexts(policy))
        ((out.float() - target.cuda()) ** 2).mean().backward()
        counts[name] = buf._shared.step - before
        grads[name] = moe.routed_experts.inner_experts.w1_EFD.grad.float().cpu()
        moe.zero_grad(set_to_none=True)
    a, b = grads.values()
    counts["grad w1 relative difference"] = worst(a, b)
    torch.save({"losses": losses, "ms": [t * 1e3 for t in times], "sac": counts,
                "replaced": replaced}, out_file)
    print("titan rank %d: fresh dispatches per fwd+bwd under SAC: %s" % (rank, counts))


def cmd_titan_ref(d):
    world = int(os.environ.get("REF_WORLD", "4"))
    init_dist(0, 1, d, "titan-ref")
    moe, _ = titan_moe(1, override=False)
    ref = []
    for step in range(STEPS):
        total = sum(titan_loss(moe, r, step) for r in range(world))
        total.backward()
        ref.append(float(total))
        sgd(moe.parameters())
    got = torch.load("%s/titan.0.pt" % d)
    bad = []
    for step, (a, b) in enumerate(zip(got["losses"], ref)):
        rel = abs(a - b) / abs(b)
        print("titan step %d loss: railwave %.6f reference %.6f (relative %.1e)" % (step, a, b,
                                                                                   rel))
        if rel > 1e-2:
            bad.append(step)
    sac = [torch.load("%s/titan.%d.pt" % (d, r))["sac"] for r in range(world)]
    print("titan SAC forward dispatches per fwd+bwd, by rank: %s" % sac)
    ok_sac = all(s.get("with railwave_selective_ac") == 1 and s.get("titan default list") == 2
                 and s.get("grad w1 relative difference", 1) <= BF16_TOL for s in sac)
    print("titan: losses %s; SAC %s" % ("EQUAL within 1e-2" if not bad else "DIFFER %s" % bad,
                                        "saves the railwave ops" if ok_sac else "UNEXPECTED"))
    return 1 if bad or not ok_sac else 0


def main():
    cmd = sys.argv[1]
    if cmd in ("megatron", "titan"):
        return {"megatron": cmd_megatron, "titan": cmd_titan}[cmd](int(sys.argv[2]),
                                                                 sys.argv[3]) or 0
    return {"megatron-ref": cmd_megatron_ref, "titan-ref": cmd_titan_ref}[cmd](sys.argv[2])


if __name__ == "__main__":
    sys.exit(main())
