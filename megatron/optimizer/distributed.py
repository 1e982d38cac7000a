"""The distributed optimizer (ZeRO-1): fp32 main parameters and optimizer state
sharded over the data-parallel group (DP x CP with context parallelism, as in
Megatron-Core; expert parameters over expert-DP).

The reducers (`GradReducer(reduce_scatter=True)`) split every gradient bucket
into DP contiguous shards and leave each rank the averaged gradient of its own
shard. A shard may cut through parameters, so this rank's part of the model is
a list of *pieces*: (parameter, [start, end) of the flattened parameter). Each
piece has an fp32 main copy and a gradient view into the reducer's buffer; the
torch optimizer steps the pieces, and the updated values are all-gathered over
DP back into the model parameters, bucket by bucket.

Adam and SGD are element-wise, so the sharded update equals the unsharded one.
The gradient norm and the fp16 overflow check are computed on the local shard
and reduced over DP and the model-parallel group.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.distributed.grads import clip_grads, expert_norm_groups, norm_and_nonfinite
from megatron.mpu.mappings import group_rank, group_size
from megatron.optimizer.optimizer import (OptimizerBase, decay_flags, regular_order,
                                          torch_optimizer)


@dataclass
class Piece:
    """The part [start, end) of flattened model parameter `index` owned by this DP rank."""

    index: int
    param: torch.nn.Parameter
    start: int
    end: int
    grad: torch.Tensor
    """View of the reducer's gradient buffer over this range."""
    main: torch.Tensor
    """fp32 copy the optimizer updates."""
    decays: bool
    """Whether its parameter gets weight decay (megatron.optimizer.optimizer.weight_decays)."""

    def model_slice(self) -> torch.Tensor:
        return self.param.data.view(-1)[self.start:self.end]


def _bucket_pieces(reducer, bucket, index_of, decays: List[bool]) -> List[Piece]:
    """The pieces of the parameters of `bucket` that fall in this rank's shard of it."""
    lo, hi = bucket.shard
    pieces = []
    for p in bucket.params:
        offset = reducer.offsets[p]
        start, end = max(lo, offset), min(hi, offset + p.numel())
        if start < end:
            main = p.detach().view(-1)[start - offset:end - offset].float().clone()
            pieces.append(Piece(index_of[p], p, start - offset, end - offset,
                                reducer.buffer[start:end], main, decays[index_of[p]]))
    return pieces


class DistributedOptimizer(OptimizerBase):
    """Same interface as MegatronOptimizer; state_dict() is this DP rank's shard."""

    is_distributed = True

    def __init__(self, cfg, models, pstate, reducers, grad_scaler=None):
        super().__init__(cfg, pstate, grad_scaler)
        # The group the dense gradients are sharded over (DP x CP); the saved shard's rank.
        dense = [r for r in reducers if not getattr(r, "experts", False)]
        self.dp_group = dense[0].dp_group if dense else pstate.dp_cp_group
        self.model_params = [p for m in models for p in m.parameters() if p.requires_grad]
        index_of = {p: i for i, p in enumerate(self.model_params)}
        self.param_decays = decay_flags(models)
        self.mixed = any(p.dtype != torch.float32 for p in self.model_params)
        self.buckets: List[Tuple[object, object, List[Piece]]] = []  # (reducer, bucket, pieces)
        for reducer in reducers:
            if not getattr(reducer, "reduce_scatter", False):
                raise ValueError("the distributed optimizer needs GradReducer(reduce_scatter=True)")
            for bucket in reducer.buckets:
                self.buckets.append((reducer, bucket, _bucket_pieces(reducer, bucket, index_of,
                                                                     self.param_decays)))
        pieces = [piece for _, _, bucket_pieces in self.buckets for piece in bucket_pieces]
        # Optimizer order (decayed pieces first) is the order of the saved state.
        self.pieces = [p for p in pieces if p.decays] + [p for p in pieces if not p.decays]
        self.optimizer = torch_optimizer(cfg, [
            {"params": [p.main for p in self.pieces if p.decays], "weight_decay": cfg.weight_decay},
            {"params": [p.main for p in self.pieces if not p.decays], "weight_decay": 0.0}])
        self.group_decays = [True, False]

    # -- the step ---------------------------------------------------------------------
    def _device(self) -> torch.device:
        return self.model_params[0].device if self.model_params else torch.device("cpu")

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], bool]:
        """One update of this rank's shard, then all-gather the parameters.
        Returns (applied, grad_norm, skipped_for_overflow)."""
        grads = [p.grad if p.grad.dtype == torch.float32 else p.grad.float() for p in self.pieces]
        try:
            for piece, g in zip(self.pieces, grads):
                piece.main.grad = g
            if self.grad_scaler is not None:
                inv = 1.0 / self.grad_scaler.scale.item()
                for g in grads:
                    g.mul_(inv)
            # The local shard's squares and non-finite counts, summed over every rank of
            # the model replicas (DP and the model-parallel group).
            norm, found_inf = norm_and_nonfinite([p.param for p in self.pieces], grads,
                                                 self.pstate.tp_group, self.pstate.mp_group,
                                                 dp_group=self.dp_group, device=self._device(),
                                                 **expert_norm_groups(self.pstate),
                                                 edp_group=self._expert_dp_group(),
                                                 starts=[p.start for p in self.pieces])
            if self.grad_scaler is not None:
                self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, True
            clip_grads(grads, norm, self.cfg.clip_grad)
            self.optimizer.step()
        finally:
            for piece in self.pieces:
                piece.main.grad = None
        self._gather_params()
        return True, norm, False

    def _gather_params(self) -> None:
        """Write each rank's updated shard into the parameters of every DP rank."""
        for reducer, bucket, pieces in self.buckets:
            dtype = bucket.params[0].dtype if bucket.params else torch.float32
            flat = torch.zeros(bucket.data.numel(), dtype=dtype, device=bucket.data.device)
            for piece in pieces:
                start = reducer.offsets[piece.param] - bucket.start + piece.start
                flat[start:start + piece.main.numel()].copy_(piece.main)
            lo, hi = bucket.shard[0] - bucket.start, bucket.shard[1] - bucket.start
            _all_gather_shards(flat, flat[lo:hi], reducer.dp_group)
            for p in bucket.params:
                start = reducer.offsets[p] - bucket.start
                p.data.view(-1).copy_(flat[start:start + p.numel()])

    def _expert_dp_group(self):
        """The expert-DP group when expert parameters have their own reducer (else None)."""
        for reducer, _, _ in self.buckets:
            if getattr(reducer, "experts", False):
                return reducer.dp_group
        return None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main shards from the model (after loading its weights)."""
        for piece in self.pieces:
            piece.main.copy_(piece.model_slice())

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This DP rank's shard: main params and optimizer state of its pieces."""
        state = {"dp_size": group_size(self.dp_group), "dp_rank": group_rank(self.dp_group),
                 "mixed": self.mixed,
                 "param_shapes": [list(p.shape) for p in self.model_params],
                 "param_decays": list(self.param_decays),
                 "pieces": [[p.index, p.start, p.end] for p in self.pieces],
                 "main_params": [p.main.detach().clone() for p in self.pieces],
                 "optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a shard saved by `state_dict()` on the same layout, or a regular
        (MegatronOptimizer) state, of which this rank takes its pieces."""
        if "pieces" not in state:
            state = shard_regular_state(state, self.model_params, self.param_decays, self.pieces,
                                        self.optimizer.state_dict()["param_groups"])
        self._check_shard(state)
        self.optimizer.load_state_dict(state["optimizer"])
        for piece, saved in zip(self.pieces, state["main_params"]):
            piece.main.copy_(saved)
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    def fits_shard(self, state: dict) -> bool:
        """Whether a saved shard covers exactly this rank's pieces (same model, DP size
        and bucket layout)."""
        mine = [[p.index, p.start, p.end] for p in self.pieces]
        shapes = [list(p.shape) for p in self.model_params]
        return state["pieces"] == mine and state.get("param_shapes", shapes) == shapes

    def _check_shard(self, state: dict) -> None:
        if not self.fits_shard(state):
            raise ValueError(
                f"the distributed optimizer shard (data-parallel rank {state.get('dp_rank')} of "
                f"{state.get('dp_size')}) was saved for another model or bucket layout; "
                f"load it with the same model flags and data-parallel size")


def _all_gather_shards(flat: torch.Tensor, shard: torch.Tensor, group) -> None:
    """Fill `flat` (DP equal slices, ours is `shard`) with every rank's slice."""
    size = group_size(group)
    if size == 1:
        return
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(flat, shard, group=group)  # in place: shard is our slice
    else:
        dist.all_gather(list(flat.chunk(size)), shard.clone(), group=group)


# -- conversion between the sharded and the regular (MegatronOptimizer) state ---------------
def saved_decays(shard: dict) -> List[bool]:
    """Whether each parameter of a saved shard gets weight decay; a shard saved before it
    recorded them decayed every parameter but the 1-D ones."""
    if "param_decays" in shard:
        return list(shard["param_decays"])
    return [len(s) != 1 for s in shard["param_shapes"]]


def merge_optimizer_shards(shards: List[dict]) -> dict:
    """The MegatronOptimizer.state_dict() equivalent to all DP shards of one model-parallel rank."""
    shards = sorted(shards, key=lambda s: s["dp_rank"])
    shapes = shards[0]["param_shapes"]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    mains = [torch.zeros(n) for n in numels]
    states: Dict[int, dict] = {}
    for shard in shards:
        saved_state = shard["optimizer"]["state"]
        for k, (index, start, end) in enumerate(shard["pieces"]):
            mains[index][start:end] = shard["main_params"][k]
            for name, value in saved_state.get(k, {}).items():
                target = states.setdefault(index, {})
                if torch.is_tensor(value) and value.dim() > 0:
                    target.setdefault(name, torch.zeros(numels[index], dtype=value.dtype))
                    target[name][start:end] = value
                else:
                    target[name] = value  # Adam's step, SGD's empty momentum
    decays = saved_decays(shards[0])
    order = regular_order(decays)
    new_id = {index: k for k, index in enumerate(order)}
    torch_state = {new_id[i]: {n: (v.view(shapes[i]) if torch.is_tensor(v) and v.dim() > 0 else v)
                               for n, v in st.items()} for i, st in states.items()}
    decay = [new_id[i] for i in order if decays[i]]
    no_decay = [new_id[i] for i in order if not decays[i]]
    saved_groups = shards[0]["optimizer"]["param_groups"]
    groups = [dict(g, params=ids) for g, ids in zip(saved_groups, (decay, no_decay)) if ids]
    regular = {"optimizer": {"state": torch_state, "param_groups": groups}}
    if "grad_scaler" in shards[0]:
        regular["grad_scaler"] = shards[0]["grad_scaler"]
    if shards[0]["mixed"]:
        regular["fp32_from_fp16_params"] = [m.view(s) for m, s in zip(mains, shapes)]
    return regular


def shard_regular_state(regular: dict, model_params: List[torch.nn.Parameter],
                        decays: List[bool], pieces: List[Piece],
                        current_groups: List[dict]) -> dict:
    """This rank's shard (in `state_dict()` form) cut from a MegatronOptimizer state of the
    parameters `model_params` (`decays`: whether each gets weight decay). `current_groups`
    (decay, no decay) supply hyper-parameters a group missing there."""
    shapes = [list(p.shape) for p in model_params]
    regular_id = {index: k for k, index in enumerate(regular_order(decays))}
    saved = regular["optimizer"]
    mains = regular.get("fp32_from_fp16_params")
    state, main_params = {}, []
    for k, piece in enumerate(pieces):
        full = mains[piece.index] if mains is not None else piece.param
        main_params.append(full.detach().reshape(-1)[piece.start:piece.end].float().clone())
        for name, value in saved["state"].get(regular_id[piece.index], {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                value = value.reshape(-1)[piece.start:piece.end].clone()
            state.setdefault(k, {})[name] = value
    saved_groups = iter(saved["param_groups"])
    groups = []
    for flag, current in zip((True, False), current_groups):
        group = dict(next(saved_groups)) if flag in decays else dict(current)
        group["params"] = [k for k, p in enumerate(pieces) if p.decays == flag]
        groups.append(group)
    shard = {"pieces": [[p.index, p.start, p.end] for p in pieces], "param_shapes": shapes,
             "param_decays": list(decays),
             "main_params": main_params, "optimizer": {"state": state, "param_groups": groups}}
    if "grad_scaler" in regular:
        shard["grad_scaler"] = regular["grad_scaler"]
    return shard
