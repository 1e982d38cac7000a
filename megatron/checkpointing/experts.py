"""Expert parallelism in checkpoints: merging the files of EP ranks, splitting for a target EP.

With EP > 1 every (TP, PP) rank has one file per EP rank, in Megatron-LM's folders
mp_rank_TT[_PPP]_EEE. Each holds the dense parameters (equal on every EP rank) and
its E / EP experts: the parameters whose sharding metadata has "expert_dim" (the
stacked expert axis, megatron/mpu/sharding.py). Merging concatenates those along the
expert axis in EP-rank order and keeps EP rank 0's dense parameters; splitting cuts
them back into EP equal blocks.

With expert TP (ETP) below TP each file mp_rank_TT[_PPP]_EEE holds TP rank TT's dense
shard and EP rank EEE's experts cut at expert-TP rank TT mod ETP; only the (TP, EP) cells
that some rank holds are saved (the TP and EP ranks are tied). `recut_expert_tp` moves the
experts of a set of TP shards between TP and ETP cuts.
"""
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.mpu.sharding import merge_shards, shard_tensor

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")

Flat = Dict[str, torch.Tensor]


def rank_of_dir(name: str, pp: int, ep: int) -> Optional[Tuple[int, int, int]]:
    """(tp, pp, ep) rank of a folder name under a layout of `pp` stages and `ep` EP ranks."""
    match = RANK_DIR.match(name)
    if not match:
        return None
    numbers = [int(g) for g in match.groups() if g is not None]
    want = 1 + (pp > 1) + (ep > 1)
    if len(numbers) != want:
        return None
    tp_rank = numbers[0]
    pp_rank = numbers[1] if pp > 1 else 0
    ep_rank = numbers[-1] if ep > 1 else 0
    return tp_rank, pp_rank, ep_rank


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: Optional[int]) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_rank is None else name + f"_{ep_rank:03d}"


def merge_experts(flats: List[Flat], sharding) -> Flat:
    """One flat state from those of EP ranks 0 .. EP - 1 (same TP and PP rank)."""
    merged = {}
    for name, tensor in flats[0].items():
        dim = sharding(name).get("expert_dim")
        merged[name] = tensor if dim is None else torch.cat([f[name] for f in flats], dim=dim)
    return merged


def split_experts(flat: Flat, ep: int, sharding) -> List[Flat]:
    """EP flat states (one per EP rank) from a state holding all experts."""
    if ep == 1:
        return [flat]
    out: List[Flat] = [{} for _ in range(ep)]
    for name, tensor in flat.items():
        dim = sharding(name).get("expert_dim")
        for e in range(ep):
            out[e][name] = tensor if dim is None else tensor.chunk(ep, dim=dim)[e].clone()
    return out


def check_split(flat: Flat, ep: int, sharding) -> Optional[str]:
    """Why the experts of `flat` cannot be split over `ep` ranks, or None."""
    for name, tensor in flat.items():
        dim = sharding(name).get("expert_dim")
        if dim is not None and tensor.shape[dim] % ep:
            return (f"{name} holds {tensor.shape[dim]} experts, not divisible by "
                    f"expert-model-parallel-size {ep}")
    return None


# -- Megatron-LM's names for the experts of one layer ---------------------------------------
_PER_EXPERT_NAMES = (
    # Megatron-Core SequentialMLP: mlp.experts.local_experts.N.linear_fc1.weight
    re.compile(r"^(.*\.mlp\.)experts\.local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)$"),
    # Megatron-Core grouped GEMM (TEGroupedMLP): mlp.experts.linear_fc1.weight0
    re.compile(r"^(.*\.mlp\.)experts\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)(?P<e>\d+)$"),
    # Megatron-LM's legacy SwitchMLP: mlp.local_experts.N.dense_h_to_4h.weight
    re.compile(r"^(.*\.mlp\.)local_experts\.(?P<e>\d+)\.(?P<fc>dense_h_to_4h|dense_4h_to_h)\.(?P<kind>weight|bias)$"),
)
_FC = {"dense_h_to_4h": "linear_fc1", "dense_4h_to_h": "linear_fc2"}


def stack_megatron_experts(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Megatron-LM's per-expert tensors (any of its three namings) stacked into ours:
    mlp.experts.linear_fc1.weight [E_local, ...] in expert order; other names unchanged."""
    out, groups = {}, {}
    for name, tensor in params.items():
        match = next((m for m in (p.match(name) for p in _PER_EXPERT_NAMES) if m), None)
        if match is None:
            out[name] = tensor
            continue
        fc = _FC.get(match.group("fc"), match.group("fc"))
        key = f"{match.group(1)}experts.{fc}.{match.group('kind')}"
        groups.setdefault(key, {})[int(match.group("e"))] = tensor
    for key, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{key}: experts {sorted(by_expert)} are not 0 .. {len(by_expert) - 1}")
        out[key] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def recut_expert_tp(shards: Dict[Tuple[int, int], Flat], tp: int, etp_from: int, etp_to: int,
                    sharding) -> Dict[Tuple[int, int], Flat]:
    """{(tp rank, pp rank): flat} whose expert tensors are cut for expert TP `etp_from`
    (TP rank t holding expert-TP rank t mod etp_from) re-cut for `etp_to`; other tensors
    are kept. Both sizes divide `tp`."""
    if etp_from == etp_to:
        return shards
    out = {key: dict(flat) for key, flat in shards.items()}
    for p in sorted({p for _, p in shards}):
        for name, tensor in shards[(0, p)].items():
            meta = sharding(name)
            if meta.get("expert_dim") is None or meta.get("dim") is None:
                continue
            full = merge_shards([shards[(k, p)][name] for k in range(etp_from)], meta)
            for t in range(tp):
                out[(t, p)][name] = shard_tensor(full, meta, t % etp_to, etp_to).clone()
    return out
