"""Process groups of one rank, built from the pure topology in `topology.py`.

`initialize_model_parallel` returns a `ParallelState`, which every user receives
explicitly: there is no module-level state to read back.
"""
from dataclasses import dataclass, field
from typing import List, Optional

import torch.distributed as dist

from megatron.mpu.topology import ParallelDims


@dataclass
class ParallelState:
    """This rank's position in the TP x CP x DP x PP grid and its process groups.

    A group is None when the run has a single process (no torch.distributed);
    every collective treats a None group, or a group of one, as a no-op.
    """

    dims: ParallelDims
    rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    tp_group: Optional[object] = None
    dp_group: Optional[object] = None
    pp_group: Optional[object] = None
    mp_group: Optional[object] = None
    embedding_group: Optional[object] = None
    pp_ranks: List[int] = field(default_factory=lambda: [0])
    dp_ranks: List[int] = field(default_factory=lambda: [0])
    embedding_ranks: List[int] = field(default_factory=lambda: [0])
    cp_rank: int = 0
    cp_group: Optional[object] = None
    ep_rank: int = 0
    edp_rank: int = 0
    ep_group: Optional[object] = None
    """Expert parallelism: the ranks that split each MoE layer's experts."""
    edp_group: Optional[object] = None
    """Expert data parallelism: the ranks holding the same experts (DP x CP re-divided)."""
    dp_cp_group: Optional[object] = None
    """DP x CP: the ranks whose dense weight gradients are reduced together (and over which
    the distributed optimizer shards them); the DP group when CP is 1."""
    etp_rank: int = 0
    etp_group: Optional[object] = None
    """Expert TP (only set when it differs from TP: ETP < TP)."""
    token_group: Optional[object] = None
    """With ETP < TP: the TP / ETP ranks of this TP group that split its tokens for the
    experts (topology.expert_token_groups); None when ETP = TP."""
    expert_mp_group: Optional[object] = None
    """ETP x EP x PP, where the gradient norm's expert terms are summed; None when that is
    TP x PP (EP 1 and ETP = TP)."""

    def __post_init__(self):
        if self.dp_cp_group is None and self.dims.cp == 1:
            self.dp_cp_group = self.dp_group  # a state built by hand: DP x CP is DP

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def edp_size(self) -> int:
        return self.dims.edp

    @property
    def dp_cp_size(self) -> int:
        return self.dims.dp * self.dims.cp

    @property
    def dp_cp_rank(self) -> int:
        """Rank in the DP x CP group (dp_rank x CP + cp_rank, Megatron-Core's order)."""
        return self.dp_rank * self.dims.cp + self.cp_rank

    def expert_groups(self) -> "ExpertGroups":
        """What MoE layers need to know of the layout."""
        return ExpertGroups(ep_group=self.ep_group, ep_rank=self.ep_rank, ep_size=self.ep_size,
                            tp_group=self.tp_group, token_group=self.token_group,
                            etp_group=self.etp_group, etp_rank=self.etp_rank)

    @property
    def etp_size(self) -> int:
        """Expert TP (--expert-tensor-parallel-size; TP by default)."""
        return self.dims.etp

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def virtual_pp_size(self) -> Optional[int]:
        return self.dims.virtual_pp

    @property
    def prev_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage, None on the first."""
        return self.pp_ranks[self.pp_rank - 1] if self.pp_rank > 0 else None

    @property
    def next_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage, None on the last."""
        return self.pp_ranks[self.pp_rank + 1] if self.pp_rank < self.pp_size - 1 else None

    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks


@dataclass(frozen=True)
class ExpertGroups:
    """Expert parallelism as seen by an MoE layer: expert TP is the layer's TP group unless
    `token_group` is set (ETP < TP), then it is `etp_group`."""

    ep_group: Optional[object] = None
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: Optional[object] = None
    token_group: Optional[object] = None
    etp_group: Optional[object] = None
    etp_rank: int = 0

    @property
    def expert_tp_group(self):
        return self.tp_group if self.token_group is None else self.etp_group


def single_process_state() -> ParallelState:
    """The state of a one-process run without torch.distributed."""
    return ParallelState(dims=ParallelDims(world_size=1))


def _my_group(groups, rank, backend, timeout=None):
    """Create every group (all ranks must call new_group identically); keep ours."""
    mine, my_ranks = None, None
    for ranks in groups:
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if rank in ranks:
            mine, my_ranks = group, ranks
    return mine, my_ranks


def initialize_model_parallel(tp: int = 1, pp: int = 1, virtual_pp: Optional[int] = None,
                              backend: Optional[str] = None, timeout=None,
                              cp: int = 1, ep: int = 1, etp: Optional[int] = None) -> ParallelState:
    """Build the TP, CP, DP, PP, model-parallel, embedding and expert (EP, expert-DP) groups
    of this rank (`etp`: expert TP, None for TP; ETP < TP adds the ETP, token-split and
    expert model-parallel groups).

    `timeout` (a timedelta) bounds every operation on them (torch's default otherwise)."""
    if not dist.is_initialized():
        if tp * pp * cp * ep != 1:
            raise ValueError(f"tensor ({tp}) x pipeline ({pp}) x context ({cp}) x expert ({ep}) "
                             f"parallelism needs torch.distributed with {tp * pp * cp * ep} or "
                             f"more processes; launch with torchrun")
        return single_process_state()
    rank = dist.get_rank()
    dims = ParallelDims(world_size=dist.get_world_size(), tp=tp, pp=pp, virtual_pp=virtual_pp,
                        cp=cp, ep=ep, etp=etp)
    pp_rank, dp_rank, tp_rank = dims.coordinates(rank)
    tp_group, _ = _my_group(dims.tensor_parallel_groups(), rank, backend, timeout)
    dp_group, dp_ranks = _my_group(dims.data_parallel_groups(), rank, backend, timeout)
    pp_group, pp_ranks = _my_group(dims.pipeline_parallel_groups(), rank, backend, timeout)
    mp_group, _ = _my_group(dims.model_parallel_groups(), rank, backend, timeout)
    emb_group, emb_ranks = _my_group(dims.embedding_groups(), rank, backend, timeout)
    cp_group, _ = _my_group(dims.context_parallel_groups(), rank, backend, timeout)
    dp_cp_group = dp_group
    if cp > 1:
        dp_cp_group, _ = _my_group(dims.data_context_parallel_groups(), rank, backend, timeout)
    _, edp_rank, ep_rank, etp_rank = dims.expert_coordinates(rank)
    ep_group, edp_group = None, dp_cp_group  # EP of one rank, ETP = TP: expert DP is DP x CP
    etp_group = token_group = expert_mp_group = None
    if ep > 1:
        ep_group, _ = _my_group(dims.expert_parallel_groups(), rank, backend, timeout)
    if ep > 1 or dims.etp != tp:
        edp_group, _ = _my_group(dims.expert_data_parallel_groups(), rank, backend, timeout)
        expert_mp_group, _ = _my_group(dims.expert_model_parallel_groups(), rank, backend,
                                       timeout)
    if dims.etp != tp:
        etp_group, _ = _my_group(dims.expert_tensor_parallel_groups(), rank, backend, timeout)
        token_group, _ = _my_group(dims.expert_token_groups(), rank, backend, timeout)
    return ParallelState(
        dims=dims, rank=rank, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
        tp_group=tp_group, dp_group=dp_group, pp_group=pp_group, mp_group=mp_group,
        embedding_group=emb_group, pp_ranks=pp_ranks, dp_ranks=dp_ranks,
        embedding_ranks=emb_ranks or [], cp_rank=dims.cp_rank_of(rank), cp_group=cp_group,
        ep_rank=ep_rank, edp_rank=edp_rank, ep_group=ep_group, edp_group=edp_group,
        dp_cp_group=dp_cp_group, etp_rank=etp_rank, etp_group=etp_group,
        token_group=token_group, expert_mp_group=expert_mp_group)
