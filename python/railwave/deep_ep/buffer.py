"""railwave.deep_ep.Buffer: the subset of DeepEP's V1 Buffer that Megatron-Core's flex token
dispatcher (deepep backend) calls, on a railwave.Group (docs/python.md "Megatron-Core").

On an eager Group every call waits on the host for the daemon, so the returned counts are
host numbers and nothing here can be captured in a CUDA graph. On a static Group (the rank
path's static mode) a dispatch with num_worst_tokens, its combine, its cached dispatch and
the backward combine read nothing back (capturable); a dispatch without num_worst_tokens reads
the received count and the counts back once, as DeepEP's host list needs. Streams are honoured the way DeepEP
does: an operation runs on the Buffer's communication stream after `previous_event` (else after
the current stream), its outputs are made there, and then either the current stream waits for
it (async_finish=False) or the returned EventOverlap marks it (async_finish=True).

Pairs. The daemon runs one dispatch/combine pair per group at a time, keyed by (layer, step).
A forward dispatch opens pair A on (LAYER, the Buffer's step); combine(handle) closes it. A
cached dispatch (dispatch(grad, handle=h): combine's backward) opens A's backward pair B with
the same routing and returns B's rows in A's order; the combine that follows with that handle
(dispatch's backward, with topk_weights for their gradient) goes through B. B is railwave's
backward pair (railwave._core Handle.open_backward / close_backward, as for Group autograd): its
rows carry the combine's topk_weights as extra columns, exact for fp32 and bf16 rows.

Errors. An argument this rank's call cannot take fails, before it is raised, the phase the
other ranks are in or about to enter (the dispatch's key is poisoned, an open pair is failed),
so that their call raises PhaseError at once instead of waiting for the daemon's phase
timeout."""
import torch

from .. import group as _group
from .._core import BACKWARD_LAYER, _static_keys, get_weights, put_weights, weight_cols
from ..errors import BadArgument, BadArgumentType, RailWaveError, ReceiveRoomExceeded
from .utils import EventHandle, EventOverlap, as_event

LAYER = 0x5EE0  # the layer of the Buffers' pairs: apart from a caller's own Group calls

class Unsupported(RailWaveError, NotImplementedError):
    """A DeepEP feature RailWave does not offer (the message says which, and what to use)."""


class Config:
    """DeepEP's Config: SM counts and chunk sizes for its kernels. Accepted and kept; RailWave
    has no kernels to tune (the daemon plans the transfer), and the size hints are 0."""

    def __init__(self, num_sms=20, *chunk_sizes):
        self.num_sms, self.chunk_sizes = num_sms, chunk_sizes

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0


class _Shared:
    """One railwave.Group per (name, rank, world) in this process, shared by every Buffer made
    on it (Megatron-Core makes a new Buffer when its size hints grow) with the step counter."""

    __slots__ = ("group", "step", "users")

    def __init__(self, group):
        self.group, self.step, self.users = group, 0, 0


_SHARED = {}


class Handle:
    """What a cached dispatch and a combine need of a dispatch (DeepEP's handle is a tuple of
    tensors; Megatron-Core passes it back untouched)."""

    __slots__ = ("shared", "a", "order", "step", "rows", "mapped", "ended")

    def __init__(self, shared, a, order, step, rows, mapped):
        self.shared, self.a, self.step = shared, a, step  # a: the railwave.Handle of pair A
        self.order = order  # returned row i < mapped is A's received row order[i]
        self.rows = rows  # rows the dispatch returned (num_worst_tokens, else those received)
        self.mapped = mapped  # of them, A's rows (the rest is padding)
        self.ended = False  # the cached dispatch ended B itself (the dispatch had no backward)

    @property
    def num_recv_tokens(self):
        """Rows received (a host read of the device count in static mode)."""
        a = self.a
        return a.num_recv if a.recv_n is None else int(a.recv_n.item())

    @property
    def src_rank(self):
        """int64 [num_recv]: the rank each returned row came from (ascending)."""
        o = self.order[:self.num_recv_tokens]
        return self.a.src_rank[o.to(self.a.src_rank.device)].cpu()

    @property
    def src_token(self):
        """int64 [num_recv]: the row's token on that rank (ascending within a rank)."""
        o = self.order[:self.num_recv_tokens]
        return self.a.src_token[o.to(self.a.src_token.device)].cpu()


def _group_of(group):
    """(rank, world size, default name) of what a caller passed as the group. A ProcessGroup
    must be the whole job in rank order (Megatron-Core's expert-parallel group with
    expert_model_parallel_size = the world size, TP = PP = CP = 1): railwaved serves groups
    that span its whole cluster, rank r on node r // LOCAL_WORLD_SIZE, so a subgroup (expert
    data parallelism) or a strided one (TP > 1) is refused here, naming its ranks."""
    if isinstance(group, _group.Group):
        return group.rank, group.world_size, group.name
    import torch.distributed as dist
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise BadArgument("deep_ep: Buffer", "group=None needs torch.distributed "
                              "initialized (or pass the expert-parallel ProcessGroup)")
        group = dist.group.WORLD
    try:
        rank, size = group.rank(), group.size()
    except AttributeError:
        raise BadArgumentType("deep_ep: Buffer", "group must be a torch.distributed "
                              "ProcessGroup or a railwave.Group, got %s"
                              % type(group).__name__) from None
    if dist.is_available() and dist.is_initialized():
        ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(len(ranks))):
            shown = ranks if len(ranks) <= 16 else ranks[:16] + ["..."]
            raise Unsupported("deep_ep: Buffer", (
                "the expert-parallel group is global ranks %s of %d: railwaved serves groups "
                "that span its whole cluster, group rank r being global rank r (on node r // "
                "LOCAL_WORLD_SIZE); a subgroup (expert data parallelism) or a strided one "
                "(tensor parallelism > 1) has no railwave group. Run with "
                "expert_model_parallel_size = the world size and TP = PP = CP = 1")
                % (shown, dist.get_world_size()))
    return rank, size, None


class Buffer:
    """DeepEP V1 Buffer(group, num_nvl_bytes, num_rdma_bytes, ...) over RailWave.

    group: the expert-parallel torch.distributed ProcessGroup, which must be the whole job in
    rank order (its rank and size are this rank's place in the RailWave group: rank r runs on
    node r // LOCAL_WORLD_SIZE; another group raises Unsupported, see _group_of), or a
    railwave.Group. The RailWave group is named by RAILWAVE_DEEP_EP_GROUP (default "deep_ep")
    and joined through RAILWAVE_SOCKET like railwave.Group. num_nvl_bytes, num_rdma_bytes,
    num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl and explicitly_destroy are
    accepted and kept (they size DeepEP's own buffers); low_latency_mode=True raises
    Unsupported. Group keyword arguments (max_tokens_per_rank, timeout, ...) may be passed as
    group_kwargs."""

    num_sms = 20  # DeepEP's default; passed on once set_num_sms was called
    _num_sms_set = False

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                 allow_mnnvl=False, explicitly_destroy=False, group_kwargs=None):
        if low_latency_mode:
            raise Unsupported("deep_ep: Buffer", "low_latency_mode: the low-latency kernels "
                              "(low_latency_dispatch/combine) have no RailWave counterpart; use "
                              "the normal dispatch/combine")
        self.group = group
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode = False
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.rank, self.group_size, name = _group_of(group)
        if isinstance(group, _group.Group):
            shared = _SHARED.setdefault(("", id(group)), _Shared(group))
        else:
            import os
            name = os.environ.get("RAILWAVE_DEEP_EP_GROUP") or "deep_ep"
            key = (name, self.rank, self.group_size)
            shared = _SHARED.get(key)
            if shared is None or shared.group._c is None:
                kw = dict(group_kwargs or {})
                if Buffer._num_sms_set:
                    kw.setdefault("num_sms", Buffer.num_sms)
                shared = _SHARED[key] = _Shared(_group.Group.from_env(
                    name, rank=self.rank, world_size=self.group_size, **kw))
        shared.users += 1
        self._shared = shared
        self.railwave_group = shared.group
        self._streams = {}

    # ---- DeepEP's static helpers ------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms):
        """DeepEP's SM count for its kernels: here the SM budget of the rank path's kernels
        (railwave.Group.set_num_sms) of every Buffer's group in this process, now and for the
        groups joined later. A bad value (not a positive int, or above the device's SMs once
        a group's rank path is open) raises BadArgument, the budget unchanged."""
        if not isinstance(new_num_sms, int) or isinstance(new_num_sms, bool) or \
                new_num_sms <= 0:
            raise BadArgument("deep_ep: set_num_sms", "a positive int, got %r" % (new_num_sms,))
        for shared in _SHARED.values():
            if shared.group._c is not None:
                shared.group.set_num_sms(new_num_sms)
        Buffer.num_sms = new_num_sms
        Buffer._num_sms_set = True

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        return 0

    @staticmethod
    def is_sm90_compiled():
        return False

    @staticmethod
    def capture():
        """An EventOverlap of the current stream now."""
        return EventOverlap(EventHandle())

    def get_comm_stream(self):
        return self._stream(torch.device("cuda", torch.cuda.current_device()))

    def destroy(self):
        """Leave the RailWave group once no Buffer of this process uses it."""
        s, self._shared = self._shared, None
        if s is not None:
            s.users -= 1
            if s.users == 0 and s.group._c is not None and \
                    not isinstance(self.group, _group.Group):
                s.group.close()

    def __getattr__(self, name):
        if name in ("low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer",
                    "get_next_low_latency_combine_buffer", "internode_dispatch",
                    "internode_combine", "get_local_buffer_tensor"):
            raise Unsupported("deep_ep: Buffer.%s" % name, "not offered: RailWave implements "
                              "get_dispatch_layout, dispatch (also cached) and combine")
        raise AttributeError(name)

    # ---- streams ----------------------------------------------------------------------------
    def _stream(self, device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def _run(self, device, previous_event, async_finish, fn, inputs=()):
        """fn() on the communication stream ordered after previous_event (else the current
        stream); returns (fn's tensors, the EventOverlap DeepEP would return). inputs: the
        caller's tensors fn reads (made on the current stream, or any other), recorded on the
        communication stream: the caller may drop them as soon as this returns, while the rank
        path's kernels that read them still wait in the stream for the daemon's plan; without
        the record the caching allocator hands their memory to the caller's next tensor."""
        prev = as_event(previous_event)
        if device.type != "cuda":
            out = fn()
            return out, EventOverlap(EventHandle.completed() if async_finish else None)
        compute = torch.cuda.current_stream(device)
        comm = self._stream(device)
        if prev is not None:
            prev.stream_wait(comm)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            out = fn()
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(comm)  # made elsewhere, read on comm
        for t in out:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(compute)  # made on comm, used on compute
        if async_finish:
            return out, EventOverlap(EventHandle(comm))
        compute.wait_stream(comm)
        return out, EventOverlap(None)

    def static_capacity(self):
        """On a static Group, the rows of the sync-free dispatch (num_worst_tokens = this):
        max_recv_tokens (at most world size × max_tokens_per_rank), else world size ×
        max_tokens_per_rank, fixed when the rank path opens; None on an eager Group."""
        g = self._shared.group
        if not g.static:
            return None
        if g._rank is not None:
            return g._rank.cap
        W, M, N = g.world_size, g.max_tokens_per_rank, g.max_recv_tokens
        if N:
            return min(N, W * M) if M else N
        if M:
            return W * M
        raise BadArgument("deep_ep: Buffer", "a static group's sync-free dispatch needs its "
                          "capacity: max_tokens_per_rank (RAILWAVE_MAX_TOKENS_PER_RANK) or "
                          "max_recv_tokens")

    # ---- failing the others' phase ----------------------------------------------------------
    def _refuse_dispatch(self, err, num_experts=None):
        """Raise err, an argument this rank's fresh dispatch (or get_dispatch_layout, before
        it) cannot take, after failing the dispatch the other ranks make with this step for
        every rank (railwave._core's _poison); the step is spent as theirs is."""
        s = self._shared
        step = s.step
        s.step += 1
        s.group._poison(LAYER, step, num_experts)
        raise err

    def _refuse_pair(self, handle, err):
        """Raise err, an argument of a cached dispatch or combine with handle, after failing
        the pair the other ranks are in: the open pair (A's combine, or B's once the cached
        dispatch opened it), else B's dispatch, which their dispatch's backward opens now."""
        g = self._shared.group
        a = getattr(handle, "a", None)
        if g._open is None and a is not None and a.combined and a.bwd is None and \
                not handle.ended:
            g._poison(a.layer | BACKWARD_LAYER, a.step, a.n_experts)
        g._refuse_combine(err)

    # ---- layout -------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """(num_tokens_per_rank int32 [W], num_tokens_per_rdma_rank None, num_tokens_per_expert
        int32 [E], is_token_in_rank bool [T, W], event). None per RDMA rank: the daemon plans
        the node level itself. dispatch() only needs num_tokens_per_expert (its length is E).
        Local: a bad argument fails the next dispatch for every rank (the one the others are
        about to make) and is raised."""
        W = self.group_size
        op = "deep_ep: get_dispatch_layout"
        try:
            self._check_idx(topk_idx, op)
            if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % W:
                raise BadArgument(op, "num_experts %r must be a positive multiple of the group "
                                  "size %d" % (num_experts, W))
            as_event(previous_event)
        except RailWaveError as e:
            self._refuse_dispatch(e, num_experts)

        def layout():
            idx = topk_idx.long()
            valid = idx >= 0
            ids = idx[valid]
            per_expert = torch.bincount(ids, minlength=num_experts).int()
            in_rank = torch.zeros(idx.shape[0], W, dtype=torch.bool, device=idx.device)
            rows = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1).expand_as(idx)
            in_rank[rows[valid], ids // (num_experts // W)] = True
            return in_rank.sum(0).int(), per_expert, in_rank

        (per_rank, per_expert, in_rank), ev = self._run(topk_idx.device, previous_event,
                                                        async_finish, layout, (topk_idx,))
        return per_rank, None, per_expert, in_rank, ev

    @staticmethod
    def _check_idx(topk_idx, op):
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or \
                topk_idx.dtype not in (torch.int32, torch.int64):
            raise BadArgumentType(op, "topk_idx must be an int64 (or int32) tensor tokens × "
                                  "topk, got %s" % (getattr(topk_idx, "dtype", topk_idx),))

    # ---- dispatch ---------------------------------------------------------------------------
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False,
                 num_experts=None):
        """DeepEP's dispatch. Fresh form (topk_idx given): returns (recv_x, recv_topk_idx int64
        local expert ids or -1, recv_topk_weights fp32 (0 where not hosted here),
        num_recv_tokens_per_expert_list (each rounded up to expert_alignment), handle, event).
        Cached form (handle given, combine's backward): returns (recv_x in that dispatch's row
        order, None, None, None, None, event). num_tokens_per_rank, num_tokens_per_rdma_rank,
        is_token_in_rank and config are accepted and unused (the daemon counts for itself);
        num_tokens_per_expert gives E (or num_experts, a RailWave keyword). num_worst_tokens > 0
        pads the received rows to that many (recv_topk_idx -1) and returns an empty list, as
        DeepEP does (still a host wait here); a rank that receives more raises
        ReceiveRoomExceeded and fails the pair for the others. allocate_on_comm_stream: outputs
        are always made on the communication stream and recorded on the current one, which is
        safe either way.

        Whether the dispatch has a backward is read from x and topk_weights: when neither
        requires grad (a frozen router over frozen inputs, as in DeepEP's use inside autograd
        functions), its backward never runs, so the cached dispatch ends the backward pair
        itself and a combine with the handle after it is refused."""
        op = "deep_ep: dispatch"
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                self._refuse_pair(handle, BadArgument(
                    op, "a cached dispatch (handle=) takes no topk_idx/topk_weights: the "
                    "handle's routing is used"))
            return self._cached_dispatch(x, handle, previous_event, async_finish)
        E = num_experts
        try:
            if isinstance(x, tuple):
                raise Unsupported(op, "FP8 rows given as (x, scales): RailWave carries float32 "
                                  "and bfloat16 rows")
            if not isinstance(x, torch.Tensor):
                raise BadArgumentType(op, "x must be a torch.Tensor, got %s" % type(x).__name__)
            if topk_idx is None:
                raise Unsupported(op, "without topk_idx (routing by is_token_in_rank alone): "
                                  "RailWave routes by expert id")
            self._check_idx(topk_idx, op)
            if num_tokens_per_expert is None and num_experts is None:
                raise BadArgument(op, "num_tokens_per_expert (from get_dispatch_layout) is "
                                  "needed: its length is the number of experts")
            if E is None:
                E = int(num_tokens_per_expert.numel())
            if not isinstance(expert_alignment, int) or expert_alignment < 1:
                raise BadArgument(op, "expert_alignment must be a positive int, got %r"
                                  % (expert_alignment,))
            if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
                raise BadArgument(op, "num_worst_tokens must be a non-negative int, got %r"
                                  % (num_worst_tokens,))
            as_event(previous_event)
        except RailWaveError as e:
            self._refuse_dispatch(e, E)
        w_given = topk_weights is not None
        backward = bool(x.requires_grad or (w_given and getattr(topk_weights, "requires_grad",
                                                                 False)))
        if not w_given:
            topk_weights = torch.ones(topk_idx.shape, dtype=torch.float32, device=x.device)
        shared = self._shared
        g = shared.group
        step = shared.step
        shared.step += 1

        if g.static and num_worst_tokens:
            if g._rank is None and not g.max_recv_tokens:
                g.max_recv_tokens = num_worst_tokens  # the capacity, fixed when the path opens
            cap = g._rank.cap if g._rank is not None else min(
                g.max_recv_tokens, g.world_size * (g.max_tokens_per_rank or g.max_recv_tokens))
            if num_worst_tokens < cap:
                self._refuse_dispatch(BadArgument(
                    op, "num_worst_tokens %d is below this static group's capacity of %d rows "
                    "(max_recv_tokens, fixed when its rank path opened)"
                    % (num_worst_tokens, cap)), E)

        al = expert_alignment

        def run():
            idx = topk_idx.contiguous()
            w = topk_weights.detach().contiguous()
            recv_x, recv_idx, recv_w, counts, a = g.dispatch(
                x.detach().contiguous(), idx, w, E, layer=LAYER, step=step)
            # Rows by (source rank, token), as DeepEP orders them: the daemon delivers them in
            # arrival order, and a dispatch recomputed by activation checkpointing must return
            # the rows of the first in the same order. Static mode: on the device, the rows
            # past the received count last.
            static = a.recv_n is not None
            order = torch.argsort(_static_keys(a) if static else a.keys().to(recv_x.device))
            recv_x, recv_idx, recv_w = recv_x[order], recv_idx[order], recv_w[order]
            if static and num_worst_tokens:  # sync-free: the capacity's rows, padded
                n = a.num_recv
            elif static:  # DeepEP's host list of counts and exact shapes: a host read
                n = int(a.recv_n.item())
                recv_x, recv_idx, recv_w = recv_x[:n], recv_idx[:n], recv_w[:n]
            else:
                n = a.num_recv
            if num_worst_tokens:
                if n > num_worst_tokens:  # fail the pair for every rank now, then say why
                    g._refuse_combine(ReceiveRoomExceeded(
                        op, "received %d rows, above num_worst_tokens %d"
                        % (n, num_worst_tokens)))
                pad = num_worst_tokens - n
                recv_x = torch.cat([recv_x, recv_x.new_zeros(pad, recv_x.shape[1])])
                recv_idx = torch.cat([recv_idx, recv_idx.new_full((pad, recv_idx.shape[1]), -1)])
                recv_w = torch.cat([recv_w, recv_w.new_zeros(pad, recv_w.shape[1])])
            # The routing the backward pair sends again, safe from in-place changes.
            a.keep_routing(idx.clone(), w.clone())
            a.dispatch_backward = backward
            # DeepEP's host list of counts, read here on the communication stream, which
            # wrote them: with async_finish the caller's stream has not waited for it yet.
            per_expert = [] if num_worst_tokens else [
                (c + al - 1) // al * al for c in counts.tolist()]
            return recv_x, recv_idx, recv_w, per_expert, Handle(shared, a, order, step,
                                                                num_worst_tokens or n, n)

        (recv_x, recv_idx, recv_w, per_expert, h), ev = self._run(x.device, previous_event,
                                                                  async_finish, run,
                                                                  (x, topk_idx, topk_weights))
        return recv_x, recv_idx, (recv_w if w_given else None), per_expert, h, ev

    def _check_handle(self, handle, op):
        if not isinstance(handle, Handle):
            self._refuse_pair(None, BadArgumentType(
                op, "handle must come from a railwave.deep_ep dispatch, got %s"
                % type(handle).__name__))
        if handle.shared is not self._shared:
            self._refuse_pair(None, BadArgument(op, "the handle is from a Buffer of another "
                                                "group"))

    def _cached_dispatch(self, x, handle, previous_event, async_finish):
        op = "deep_ep: dispatch(handle=)"
        self._check_handle(handle, op)
        a = handle.a
        try:
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != a.num_tokens:
                raise BadArgument(op, "x must be (tokens %d of the handle's dispatch) × hidden, "
                                  "got %s" % (a.num_tokens, tuple(getattr(x, "shape", ()))))
            if x.dtype not in (torch.float32, torch.bfloat16):
                raise BadArgumentType(op, "x has dtype %s; RailWave carries float32 and "
                                      "bfloat16 rows" % x.dtype)
            if handle.ended or a.bwd is not None:
                raise BadArgument(op, "this handle's backward pair was already opened")
            as_event(previous_event)
        except RailWaveError as e:
            self._refuse_pair(handle, e)
        H = x.shape[1]

        def run():
            rows = torch.zeros(x.shape[0], H + weight_cols(x.dtype, a.topk), dtype=x.dtype,
                               device=x.device)
            rows[:, :H] = x.detach()
            m = handle.mapped
            recv = a.open_backward(rows)[handle.order[:m].to(x.device), :H]
            handle.ended = a.bwd is None  # no backward of the dispatch: B ended already
            if handle.rows > m:
                recv = torch.cat([recv, recv.new_zeros(handle.rows - m, H)])
            return (recv.contiguous(),)

        (recv,), ev = self._run(x.device, previous_event, async_finish, run, (x,))
        return recv, None, None, None, None, ev

    # ---- combine ----------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's combine: (combined_x T × hidden, combined_topk_weights fp32 T × topk or None,
        event). x: one row per received row, in recv_x's order. After a cached dispatch with
        this handle it goes through that pair and may carry topk_weights (their sum back at
        each token's owner; entries of experts not hosted here are taken as 0, as dispatch
        returns them). A forward combine (no cached dispatch yet) with topk_weights raises
        Unsupported. bias (a tensor or a pair) is added to combined_x. config is unused."""
        op = "deep_ep: combine"
        self._check_handle(handle, op)
        a = handle.a
        m = handle.mapped
        want = handle.rows
        forward = not a.combined
        try:
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                raise BadArgumentType(op, "x must be a 2-D torch.Tensor")
            if x.shape[0] != want:
                raise BadArgument(op, "x has %d rows, the dispatch received %d"
                                  % (x.shape[0], want))
            if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor) or
                                             tuple(topk_weights.shape) != (want, a.topk)):
                raise BadArgument(op, "topk_weights must be (rows %d) × (topk %d)"
                                  % (want, a.topk))
            if forward and topk_weights is not None:
                raise Unsupported(op, "with topk_weights is offered after a cached dispatch "
                                  "with this handle (dispatch's backward); the forward pair "
                                  "carries rows only")
            if handle.ended:
                raise BadArgument(op, "the cached dispatch ended this handle's backward pair: "
                                  "its dispatch had no backward (neither x nor topk_weights "
                                  "required grad)")
            if a.bwd is not None:
                b = a.bwd[0]
                H = b.hidden - weight_cols(b.dtype, a.topk)
                if x.shape[1] != H:
                    raise BadArgument(op, "x has hidden %d, the cached dispatch carried %d"
                                      % (x.shape[1], H))
            as_event(previous_event)
        except RailWaveError as e:
            self._refuse_pair(handle, e)

        def run():
            y = x.detach()[:m]
            order = handle.order[:m].to(y.device)
            n = a.num_recv  # A's rows: those received (static mode: the capacity)
            if forward:
                y_a = y.new_zeros(n, y.shape[1])
                y_a[order] = y  # back to A's order
                return self._shared.group.combine(y_a, a), None
            dtype = a.bwd[0].dtype if a.bwd is not None else y.dtype
            H = y.shape[1]
            rows = torch.zeros(n, H + weight_cols(dtype, a.topk), dtype=dtype, device=y.device)
            rows[order, :H] = y.to(dtype)
            if topk_weights is not None:
                w = topk_weights.detach()[:m].float() * a.local_mask.to(y.device)[order]
                w_a = w.new_zeros(n, w.shape[1])
                w_a[order] = w
                put_weights(rows, H, w_a)
            out = a.close_backward(rows)
            cw = get_weights(out, H, a.topk) if topk_weights is not None else None
            return out[:, :H].to(x.dtype).contiguous(), cw

        (out, cw), ev = self._run(x.device, previous_event, async_finish, run,
                                  (x, topk_weights))
        if bias is not None:
            for b_t in (bias if isinstance(bias, (tuple, list)) else (bias,)):
                if b_t is not None:
                    out = out + b_t
        return out, cw, ev
