"""Rank arithmetic for 3D parallelism: pure functions, no torch.distributed.

Megatron's rank order: global rank = pp_rank * (TP * DP) + dp_rank * TP + tp_rank.
Tensor-parallel groups are therefore contiguous ranks (one node keeps its TP
traffic on NVLink), data-parallel groups stride by TP and pipeline groups stride
by TP * DP.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a run, validated against the world size."""

    world_size: int
    tp: int = 1
    pp: int = 1
    virtual_pp: Optional[int] = None

    def __post_init__(self):
        for name in ("world_size", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % (self.tp * self.pp) != 0:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by tensor-model-parallel-size "
                f"({self.tp}) x pipeline-model-parallel-size ({self.pp}); choose sizes whose "
                f"product divides the number of processes")
        if self.virtual_pp is not None and self.virtual_pp > 1 and self.pp < 2:
            raise ValueError(
                f"virtual pipeline stages ({self.virtual_pp}) need pipeline-model-parallel-size > 1 "
                f"(got {self.pp})")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coordinates(self, rank: int) -> Tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        pp_rank, rest = divmod(rank, self.tp * self.dp)
        dp_rank, tp_rank = divmod(rest, self.tp)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp * self.dp + dp_rank * self.tp + tp_rank

    def tensor_parallel_groups(self) -> List[List[int]]:
        return [[self.rank_of(p, d, t) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def data_parallel_groups(self) -> List[List[int]]:
        return [[self.rank_of(p, d, t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pipeline_parallel_groups(self) -> List[List[int]]:
        return [[self.rank_of(p, d, t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def model_parallel_groups(self) -> List[List[int]]:
        """All TP x PP ranks that hold one copy of the model (one per DP rank)."""
        return [[self.rank_of(p, d, t) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp)]

    def embedding_groups(self) -> List[List[int]]:
        """First and last stage of each pipeline: they share the tied word embeddings."""
        groups = []
        for ranks in self.pipeline_parallel_groups():
            groups.append([ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]])
        return groups
