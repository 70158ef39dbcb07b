"""TorchTitan's expert-parallel token dispatch through RailWave, activated without patching
TorchTitan (docs/python.md "TorchTitan"):

    --override.imports railwave.torchtitan.railwave_dispatcher,railwave.torchtitan.railwave_selective_ac

railwave_dispatcher replaces every expert-parallel token dispatcher config of the model
(BaseEPTokenDispatcher.Config: the all-to-all, DeepEP, HybridEP, ... ones) with
RailWaveTokenDispatcher.Config; kwargs: expert_alignment (rows per expert padded to a multiple
of it, default 1) and max_tokens_per_rank (the receive room, else num_max_tokens_per_rank of the
replaced config, else RAILWAVE_MAX_TOKENS_PER_RANK). railwave_selective_ac makes selective
activation checkpointing save the outputs of railwave::dispatch and railwave::combine (TorchTitan's
own save list names DeepEP's and HybridEP's operators only): without it they are recomputed in
the backward, i.e. communicated again.

Dispatch and combine are the torch.library operators of railwave.ops; routing scores are
applied to the expert outputs on the expert's rank before the combine, in PyTorch, so autograd
carries their gradient back through dispatch's backward. On an eager Group each call waits for
the daemon on the host and the expert-major rows are sized from the counts (a host read). On a
static Group (RAILWAVE_STATIC=1, with max_tokens_per_rank) the dispatcher is sync-free: the
Buffer's num_worst_tokens form (rows padded to the capacity) and the fixed-size expert-major
layout (railwave.layout.expert_major_static: each local expert's block padded to the
alignment, zero rows to a size set by the shapes), so nothing of the layer's forward or
backward reads the device. Importing this module needs TorchTitan."""
from dataclasses import dataclass

import torch
from torchtitan.config import override
from torchtitan.config.override import derive
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.token_dispatcher import (BaseEPTokenDispatcher,
                                                       LocalTokenDispatcher)

from . import ops
from .deep_ep import Buffer
from .errors import BadArgument, BadArgumentType
from .layout import ExpertMajor, combine_rows, expert_major, expert_major_static


@dataclass(frozen=True)
class RailWaveDispatchMetadata:
    """What combine needs: the dispatch's handle (an operator argument) and the expert-major
    layout."""

    handle_id: torch.Tensor
    layout: ExpertMajor


class RailWaveTokenDispatcher(BaseEPTokenDispatcher):
    """BaseEPTokenDispatcher over railwaved: dispatch returns the received tokens in
    expert-major order (each local expert's rows padded to expert_alignment), the rows per
    local expert, and the metadata combine needs. Without an EP mesh it is TorchTitan's local
    dispatcher."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        expert_alignment: int = 1
        num_max_tokens_per_rank: int | None = None

    def __init__(self, config):
        super().__init__(config)
        if config.expert_alignment < 1:
            raise BadArgument("RailWaveTokenDispatcher", "expert_alignment must be >= 1, got %d"
                              % config.expert_alignment)
        self.expert_alignment = config.expert_alignment
        self.num_max_tokens_per_rank = config.num_max_tokens_per_rank

    def init_buffer(self):
        """Join the RailWave group of the EP mesh (shared by every layer's dispatcher)."""
        if self.ep_mesh is None:
            return
        kw = {}
        if self.num_max_tokens_per_rank:
            kw["max_tokens_per_rank"] = self.num_max_tokens_per_rank
        ops.use(Buffer(self.ep_mesh.get_group(), group_kwargs=kw))

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        if self.ep_mesh is None:
            return LocalTokenDispatcher.dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK,
                                                 num_local_tokens_per_expert_E)
        worst = ops._buffer().static_capacity() or 0  # a static Group: the sync-free form
        recv_x, recv_idx, recv_w, _, handle_id = ops.dispatch(
            x_TD.contiguous(), topk_expert_ids_TK.contiguous(),
            topk_scores_TK.float().contiguous(), self.num_experts, worst)
        local = self.num_experts // self.ep_mesh.size()
        layout_of = expert_major_static if worst else expert_major
        rows, layout = layout_of(recv_x, recv_idx, recv_w, local, self.expert_alignment)
        return rows, layout.counts, RailWaveDispatchMetadata(handle_id, layout)

    # Keywords newer TorchTitan passes to every dispatcher's combine (keyword-only): the token
    # count and sequence length of this rank's shard after sequence-parallel padding, which its
    # own dispatchers use to restore that padding. RailWave's dispatch pads nothing: combine
    # returns one row per token dispatch was given (x_TD's), so they are accepted and unused.
    COMBINE_KEYWORDS = ("num_local_tokens_after_padding", "local_seq_len_after_padding")

    def combine(self, routed_output_RD, metadata, x_TD, **kwargs):
        """Sum the expert outputs back into x_TD's tokens. kwargs: COMBINE_KEYWORDS (accepted,
        passed on to TorchTitan's local dispatcher without an EP mesh); another keyword raises
        BadArgumentType."""
        unknown = sorted(set(kwargs) - set(self.COMBINE_KEYWORDS))
        if unknown:
            raise BadArgumentType("RailWaveTokenDispatcher.combine", "unexpected keyword(s) %s "
                                  "(accepted: %s)" % (", ".join(unknown),
                                                      ", ".join(self.COMBINE_KEYWORDS)))
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD, **kwargs)
        rows = combine_rows(routed_output_RD, metadata.layout)
        return ops.combine(rows.contiguous(), metadata.handle_id)


@override(target=BaseEPTokenDispatcher.Config,
          description="RailWave: expert-parallel dispatch/combine through railwaved")
def railwave_dispatcher(cfg, *, expert_alignment=1, max_tokens_per_rank=None):
    deltas = {"expert_alignment": expert_alignment}
    if max_tokens_per_rank is not None:
        deltas["num_max_tokens_per_rank"] = max_tokens_per_rank
    return derive(cfg, RailWaveTokenDispatcher.Config, **deltas)


class RailWaveSelectiveAC(SelectiveAC):
    """TorchTitan's selective activation checkpointing, saving railwave::dispatch and
    railwave::combine too."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self):
        save = set(super().get_save_ops())
        save.update(ops.save_list())
        return save


@override(target=SelectiveAC.Config, exact=True,
          description="RailWave: selective AC saves railwave::dispatch/combine")
def railwave_selective_ac(cfg):
    return derive(cfg, RailWaveSelectiveAC.Config)
