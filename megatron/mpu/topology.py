"""Rank arithmetic for 3D parallelism: pure functions, no torch.distributed.

Megatron-Core's rank order tp-cp-dp-pp (RankGenerator): global rank =
pp_rank * (TP * CP * DP) + dp_rank * (TP * CP) + cp_rank * TP + tp_rank.
Tensor-parallel groups are therefore contiguous ranks (one node keeps its TP
traffic on NVLink), context-parallel groups stride by TP, data-parallel groups
by TP * CP and pipeline groups by TP * CP * DP.

Expert parallelism (Megatron-Core's RankGenerator, order tp-cp-ep-dp-pp) re-divides
the TP x CP x DP ranks of each pipeline stage (a contiguous block of `stage_size` ranks)
into expert-TP (fastest), EP, then expert-DP: with ETP = TP and CP = 1 an EP group is EP
consecutive DP ranks; with CP > 1 the EP groups run over CP first, and expert-DP spans
DP x CP. Dense weight gradients are reduced over DP x CP (`data_context_parallel_groups`),
expert gradients over the expert-DP ranks only, each once.

ETP may be smaller than TP (it must divide it): then each ETP group is a block of ETP
consecutive ranks inside a TP group, and the TP / ETP blocks of one TP group split the
tokens that the TP ranks share (`expert_token_groups`: the ranks of one TP group with the
same rank in their block), so each token reaches its experts once.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple


FLAGS = {"world_size": "the world size", "tp": "--tensor-model-parallel-size",
         "pp": "--pipeline-model-parallel-size", "cp": "--context-parallel-size",
         "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size"}


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run, validated against the world size."""

    world_size: int
    tp: int = 1
    pp: int = 1
    virtual_pp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    """Expert tensor parallelism (None: TP)."""

    def __post_init__(self):
        """The one place the degrees are checked against each other and the world size; the
        messages name Megatron-LM's flags (Config.check_layout passes them on)."""
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{FLAGS.get(name, name)} must be >= 1, got {getattr(self, name)}")
        tp, pp, cp, ep, etp = self.tp, self.pp, self.cp, self.ep, self.etp
        if self.world_size % (tp * cp * pp) != 0:
            raise ValueError(
                f"--tensor-model-parallel-size ({tp}) x --context-parallel-size ({cp}) x "
                f"--pipeline-model-parallel-size ({pp}) must divide the world size "
                f"({self.world_size})")
        if etp > tp:
            raise ValueError(f"--expert-tensor-parallel-size ({etp}) larger than "
                             f"--tensor-model-parallel-size ({tp}) is not supported; use a "
                             f"divisor of {tp}")
        if tp % etp != 0:
            raise ValueError(f"--expert-tensor-parallel-size ({etp}) must divide "
                             f"--tensor-model-parallel-size ({tp}); use a divisor of {tp}")
        if self.stage_size % (etp * ep) != 0:
            split = FLAGS["tp" if etp == tp else "etp"]  # the expert TP, named as given
            raise ValueError(f"--expert-model-parallel-size ({ep}) x {split} ({etp}) x "
                             f"--pipeline-model-parallel-size ({pp}) must divide the world size "
                             f"({self.world_size})")
        if self.virtual_pp is not None and pp < 2:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage needs "
                             f"--pipeline-model-parallel-size > 1 (got {pp})")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (what expert parallelism re-divides)."""
        return self.world_size // self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard per stage."""
        return self.stage_size // (self.etp * self.ep)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")

    def coordinates(self, rank: int) -> Tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank (its cp_rank: `cp_rank_of`)."""
        self._check_rank(rank)
        pp_rank, rest = divmod(rank, self.tp * self.cp * self.dp)
        dp_rank, rest = divmod(rest, self.tp * self.cp)
        return pp_rank, dp_rank, rest % self.tp

    def cp_rank_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.tp % self.cp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def _grid(self):
        return [(p, d, c, t) for p in range(self.pp) for d in range(self.dp)
                for c in range(self.cp) for t in range(self.tp)]

    def _groups(self, varying: str) -> List[List[int]]:
        """Ranks that differ only in the coordinates named in `varying` (of "pdct")."""
        groups: dict = {}
        for coords in self._grid():
            key = tuple(x for x, name in zip(coords, "pdct") if name not in varying)
            p, d, c, t = coords
            groups.setdefault(key, []).append(self.rank_of(p, d, t, c))
        return list(groups.values())

    def tensor_parallel_groups(self) -> List[List[int]]:
        return self._groups("t")

    def context_parallel_groups(self) -> List[List[int]]:
        return self._groups("c")

    def data_parallel_groups(self) -> List[List[int]]:
        return self._groups("d")

    def data_context_parallel_groups(self) -> List[List[int]]:
        """DP x CP: the ranks whose weight gradients are reduced together."""
        return self._groups("dc")

    def pipeline_parallel_groups(self) -> List[List[int]]:
        return self._groups("p")

    def model_parallel_groups(self) -> List[List[int]]:
        """All TP x PP ranks that hold one copy of the model (one per DP and CP rank)."""
        return self._groups("pt")

    def embedding_groups(self) -> List[List[int]]:
        """First and last stage of each pipeline: they share the tied word embeddings."""
        groups = []
        for ranks in self.pipeline_parallel_groups():
            groups.append([ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]])
        return groups

    # -- expert parallelism --------------------------------------------------------
    def expert_coordinates(self, rank: int) -> Tuple[int, int, int, int]:
        """(pp_rank, edp_rank, ep_rank, etp_rank) of a global rank."""
        pp_rank, local = divmod(rank, self.stage_size)
        rest, etp_rank = divmod(local, self.etp)
        edp_rank, ep_rank = divmod(rest, self.ep)
        return pp_rank, edp_rank, ep_rank, etp_rank

    def expert_rank_of(self, pp_rank: int, edp_rank: int, ep_rank: int, etp_rank: int) -> int:
        return (pp_rank * self.stage_size + (edp_rank * self.ep + ep_rank) * self.etp
                + etp_rank)

    def _expert_groups(self, axis: str) -> List[List[int]]:
        sizes = {"etp": self.etp, "ep": self.ep, "edp": self.edp}
        others = [a for a in ("etp", "ep", "edp") if a != axis]
        groups = []
        for p in range(self.pp):
            for i in range(sizes[others[1]]):
                for j in range(sizes[others[0]]):
                    coords = {others[0]: j, others[1]: i}
                    ranks = []
                    for k in range(sizes[axis]):
                        coords[axis] = k
                        ranks.append(self.expert_rank_of(p, coords["edp"], coords["ep"],
                                                         coords["etp"]))
                    groups.append(ranks)
        return groups

    def expert_parallel_groups(self) -> List[List[int]]:
        """Ranks that split the experts of a layer (tokens are exchanged among them)."""
        return self._expert_groups("ep")

    def expert_tensor_parallel_groups(self) -> List[List[int]]:
        return self._expert_groups("etp")

    def expert_data_parallel_groups(self) -> List[List[int]]:
        """Ranks holding the same expert shard: expert gradients are reduced over them."""
        return self._expert_groups("edp")

    def expert_token_groups(self) -> List[List[int]]:
        """With ETP < TP: the TP / ETP ranks of one TP group that have the same rank in
        their ETP block; the tokens the TP group shares are split over them (one block of
        tokens per ETP block). Groups of one rank when ETP = TP."""
        groups: dict = {}
        for rank in range(self.world_size):
            key = (rank // self.tp, rank % self.etp)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def expert_model_parallel_groups(self) -> List[List[int]]:
        """ETP x EP x PP: the ranks that together hold one copy of every expert shard (one
        per expert-DP rank), over which the gradient norm's expert terms are summed."""
        groups: dict = {}
        for rank in range(self.world_size):
            groups.setdefault(self.expert_coordinates(rank)[1], []).append(rank)
        return list(groups.values())

    def first_of_cell(self, rank: int) -> bool:
        """Whether `rank` is the lowest rank of its stage holding its (TP rank, EP rank):
        the rank that writes that cell's checkpoint file. With ETP = TP that is expert-DP
        rank 0; with ETP < TP the TP and EP ranks are tied and only some cells exist."""
        def cell(r):
            return self.coordinates(r)[2], self.expert_coordinates(r)[2]
        first = rank // self.stage_size * self.stage_size
        return all(cell(other) != cell(rank) for other in range(first, rank))
