"""This rank's model and optimizer tensors as torch.distributed.checkpoint ShardedTensors.

`Entries` lists every tensor of the rank's model chunks that a checkpoint holds (the
parameters and the persistent buffers, such as the routers' expert bias, Megatron-Core's
`decoder.layers.mlp.router.expert_bias` [L, E]) with its Megatron-Core key (mcore_keys.py)
and its placement in the global tensor (dist_regions.py). From them:

- model regions: the weights and buffers (views of the live tensors);
- optimizer regions, keys `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>`, in
  model space, so that they re-shard like the weights: the regular optimizer holds whole
  shards, the distributed optimizer its flat pieces (cut into rectangles).

For saving the regions view the live tensors (DCP copies them); for loading they view
fresh buffers (`OptimizerBuffers`) that are then handed to the optimizer's
`load_state_dict`. The last stage's copy of tied embeddings is the first stage's tensor:
it is saved once (by the first stage) and loaded from the same key.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.checkpointing.dist_regions import (Placement, flat_piece_regions, placement,
                                                 sharded_tensors, split_regions)
from megatron.checkpointing.mcore_keys import mcore_key, optimizer_key, stacks_layers
from megatron.mpu.fsdp_shards import like, local, local_shape, shard_offsets

FP32 = "fp32_param"


@dataclass
class Entry:
    tensor: torch.Tensor
    """A parameter or a persistent buffer (or, for whole models, its full tensor)."""
    place: Placement
    head_copy: bool
    buffer: bool = False
    """A persistent buffer: checkpoints saved before buffers were may lack it."""


Naming = Callable[[str, object], Tuple[str, Optional[int]]]
"""(global parameter name, ModelConfig) -> (checkpoint key, index along a stacked layer axis
or None): how a DCP format names the model's tensors."""


def sharded_key(global_name: str, cfg) -> Tuple[str, Optional[int]]:
    """torch_dist's naming: Megatron-Core's sharded_state_dict keys, layers stacked where
    it stacks them (mcore_keys.py)."""
    return mcore_key(global_name, stacks_layers(cfg), cfg.multi_latent_attention)


def model_entries(models, pstate, num_layers: int, naming: Naming = sharded_key) -> List[Entry]:
    """Every checkpoint tensor of this rank's chunks (GPTModel.checkpoint_tensors), in the
    chunks' order, keyed by `naming`."""
    entries = []
    for model in models:
        meta = model.sharding_metadata()
        for name, tensor in model.checkpoint_tensors().items():
            key, layer = naming(model.global_name(name), model.cfg)
            place = placement(key, layer, num_layers, tuple(tensor.shape), meta[name],
                              *split_of(meta[name], pstate))
            entries.append(Entry(tensor, place, bool(getattr(tensor, "shared_embedding", False)),
                                 not isinstance(tensor, torch.nn.Parameter)))
    return entries


def buffer_keys(entries: List[Entry], prefix: str = "") -> List[str]:
    """The keys of the persistent buffers among `entries` (as model_state names them)."""
    return sorted({prefix + e.place.key for e in entries if e.buffer})


def split_of(meta: dict, pstate) -> Tuple[int, int, int]:
    """(TP rank, TP size, EP rank) that split a parameter: for expert parameters the
    expert-TP rank and size (ParallelDims.etp), which need not be TP's."""
    if meta.get("expert_dim") is None:
        return pstate.tp_rank, pstate.tp_size, 0
    dims = pstate.dims
    _, _, ep_rank, etp_rank = dims.expert_coordinates(pstate.rank)
    return etp_rank, dims.etp, ep_rank


def _add(regions: dict, shapes: dict, key: str, shape, pieces) -> None:
    if pieces:
        regions.setdefault(key, []).extend(pieces)
        shapes[key] = shape


def model_state(entries: List[Entry], rank: int, world: int, saving: bool,
                prefix: str = "") -> dict:
    """{`prefix` + key: ShardedTensor} of the weights (views of the parameters and
    buffers)."""
    regions, shapes = {}, {}
    for e in entries:
        if saving and e.head_copy:
            continue
        _add(regions, shapes, prefix + e.place.key, e.place.global_shape,
             _shard_regions(e, e.tensor))
    return sharded_tensors(regions, shapes, rank, world)


def _shard_regions(entry: Entry, tensor: torch.Tensor):
    """The regions of `tensor` (the entry's parameter, or its optimizer state, as shaped as
    it): under FSDP this rank's dim-0 shard of it, at its row offset; none when empty."""
    param = entry.tensor
    view = local(tensor).detach().view(local_shape(param))
    if view.dim() and not view.numel():
        return []
    return split_regions(entry.place, view, shard_offsets(param))


def saves_fp32(optimizer) -> bool:
    """Whether the optimizer's fp32 main parameters are saved (`fp32_param`) apart from the
    weights: those of the distributed optimizer and of a bf16 / fp16 model; under FSDP with
    bf16 compute (`fp32_main_params`), the fp32 shards, so that a bf16 run without FSDP
    resumes from them exactly."""
    return (optimizer.is_distributed or optimizer.mixed
            or getattr(optimizer, "fp32_main_params", False))


def moment_names(optimizer) -> List[str]:
    """Names of the per-element optimizer tensors (Adam's exp_avg, exp_avg_sq; SGD's
    momentum_buffer); empty before the first step."""
    for state in optimizer.optimizer.state.values():
        return sorted(name for name, value in state.items()
                      if torch.is_tensor(value) and value.dim() > 0)
    return []


class OptimizerTensors:
    """The optimizer's per-parameter tensors, live (saving) or fresh buffers (loading)."""

    def __init__(self, optimizer, entries: List[Entry], moments: List[str], fresh: bool):
        self.optimizer, self.moments, self.fresh = optimizer, moments, fresh
        self.by_param = {id(e.tensor): e for e in entries}
        self.tensors: Dict[int, Dict[str, torch.Tensor]] = {}
        """Distributed: piece number -> {name: flat}; regular: param index -> {name: shard}."""
        units = optimizer.pieces if optimizer.is_distributed else optimizer.model_params
        for k, unit in enumerate(units):
            self.tensors[k] = self._tensors(k, unit)

    def _live(self, k: int) -> Dict[str, torch.Tensor]:
        opt = self.optimizer
        main = opt.pieces[k].main if opt.is_distributed else opt.main_params[k]
        state = opt.optimizer.state.get(main, {})
        out = {FP32: main} if saves_fp32(opt) else {}
        out.update({m: state[m] for m in self.moments if m in state})
        return out

    def _tensors(self, k: int, unit) -> Dict[str, torch.Tensor]:
        if not self.fresh:
            return self._live(k)
        shape = (unit.main.numel(),) if self.optimizer.is_distributed else local_shape(unit)
        opt = self.optimizer
        names = ([FP32] if saves_fp32(opt) else []) + list(self.moments)
        return {name: torch.zeros(shape, dtype=torch.float32) for name in names}

    def state(self, rank: int, world: int, saving: bool) -> dict:
        regions, shapes = {}, {}
        opt = self.optimizer
        for k, tensors in self.tensors.items():
            param = opt.pieces[k].param if opt.is_distributed else opt.model_params[k]
            entry = self.by_param[id(param)]
            if saving and entry.head_copy:
                continue
            for name, tensor in tensors.items():
                key = optimizer_key(name, entry.place.key)
                _add(regions, shapes, key, entry.place.global_shape,
                     self._regions(entry, param, tensor, k))
        return sharded_tensors(regions, shapes, rank, world)

    def _regions(self, entry: Entry, param, tensor, k: int):
        if self.optimizer.is_distributed:
            return flat_piece_regions(entry.place, tuple(param.shape), tensor.detach().view(-1),
                                      self.optimizer.pieces[k].start)
        return _shard_regions(entry, tensor)



def group_decays(optimizer, i: int) -> bool:
    """Whether param group `i` is the weight-decay group (matrices) or not (biases, norms)."""
    return optimizer.group_decays[i]


def optimizer_common(optimizer, moments: List[str]) -> dict:
    """What the optimizer state holds besides per-element tensors (step, hyper-parameters)."""
    groups = [dict({k: v for k, v in group.items() if k != "params"},
                   decays=group_decays(optimizer, i))
              for i, group in enumerate(optimizer.optimizer.param_groups)]
    step: Optional[float] = None
    for state in optimizer.optimizer.state.values():
        if "step" in state:
            step = float(state["step"])
            break
    common = {"moments": list(moments), "step": step, "param_groups": groups,
              "distributed": optimizer.is_distributed}
    if optimizer.grad_scaler is not None:
        common["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return common


def _param_groups(optimizer, common: dict) -> List[dict]:
    """The current groups (their parameter ids) with the saved hyper-parameters."""
    saved = {g["decays"]: g for g in common["param_groups"]}
    groups = []
    for i, group in enumerate(optimizer.optimizer.state_dict()["param_groups"]):
        found = saved.get(group_decays(optimizer, i), {})
        hyper = {k: v for k, v in found.items() if k not in ("params", "decays")}
        groups.append(dict(group, **hyper))
    return groups


def _torch_state(tensors: Dict[str, torch.Tensor], common: dict, shape=None) -> dict:
    out = {m: (t.view(shape) if shape is not None else t)
           for m, t in tensors.items() if m != FP32}
    if out and common["step"] is not None:
        out["step"] = torch.tensor(common["step"], dtype=torch.float32)
    return out


def load_distributed(optimizer, loaded: OptimizerTensors, common: dict, have_fp32: bool) -> None:
    """Hand the loaded pieces to the distributed optimizer as its own shard."""
    mains, state = [], {}
    for k, piece in enumerate(optimizer.pieces):
        tensors = loaded.tensors[k]
        mains.append(tensors[FP32] if have_fp32 else piece.model_slice().float().clone())
        state[k] = _torch_state(tensors, common)
    shard = {"pieces": [[p.index, p.start, p.end] for p in optimizer.pieces],
             "param_shapes": [list(p.shape) for p in optimizer.model_params],
             "main_params": mains,
             "optimizer": {"state": state, "param_groups": _param_groups(optimizer, common)}}
    if "grad_scaler" in common:
        shard["grad_scaler"] = common["grad_scaler"]
    optimizer.load_state_dict(shard)


def load_regular(optimizer, loaded: OptimizerTensors, common: dict, have_fp32: bool) -> None:
    """Hand the loaded shards to the regular optimizer in its state_dict() form."""
    index_of = {id(main): i for i, main in enumerate(optimizer.main_params)}
    state, at = {}, 0
    for group in optimizer.optimizer.param_groups:
        for main in group["params"]:
            i = index_of[id(main)]
            torch_state = _torch_state(loaded.tensors[i], common, local_shape(main))
            # under FSDP each moment a DTensor placed as its parameter (the step stays plain)
            state[at] = {name: like(value, main) if value.dim() else value
                         for name, value in torch_state.items()}
            at += 1
    regular = {"optimizer": {"state": state, "param_groups": _param_groups(optimizer, common)}}
    if optimizer.mixed or (saves_fp32(optimizer) and have_fp32):
        regular["fp32_from_fp16_params"] = [
            loaded.tensors[i][FP32].view(local_shape(p)) if have_fp32 else p.detach().float()
            for i, p in enumerate(optimizer.model_params)]
    if "grad_scaler" in common:
        regular["grad_scaler"] = common["grad_scaler"]
    optimizer.load_state_dict(regular)
