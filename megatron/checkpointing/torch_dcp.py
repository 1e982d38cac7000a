"""--ckpt-format torch_dcp: Megatron-LM's plain torch.distributed.checkpoint of the model.

Megatron-LM (`--ckpt-format torch_dcp`, which it offers with `--use-torch-fsdp2`) writes one
`torch.distributed.checkpoint.save` of its checkpoint dict per iteration, no Megatron-Core
`sharded_state_dict` and no `common.pt` / `metadata.json` beside it:

    <root>/latest_checkpointed_iteration.txt
    <root>/iter_0000100/.metadata, __R_0.distcp    DCP's metadata and each rank's chunks
    <root>/iter_0000100/checksums.sha256           ours: sha256sum of the files above

Inside, as Megatron-LM flattens its dict: `model.<name>` for every tensor of
`GPTModel.state_dict()` (Megatron-Core's module names, each layer on its own:
`model.decoder.layers.3.self_attention.linear_qkv.weight`, the layer norms unfused as its
local spec names them, `input_layernorm` / `pre_mlp_layernorm`, and a None
`model.<linear>._extra_state` beside each linear as that state dict has), `iteration`,
`checkpoint_version` (3.0) and `args` (Megatron-LM's argparse names, as our torch format's
files carry). What is ours: the optimizer tensors under the names torch_dist gives them
(`optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>`: Megatron-LM's own optimizer
entry numbers the parameters in its param-group order, which no other layout shares), and
`common`, the bytes of torch_dist's common.pt (config, counters, schedule, optimizer step,
every rank's RNG state; read with torch.load(weights_only=True)).

Each rank writes only its own chunks at their global offsets (DP / FSDP shards, TP, PP, EP
alike), so a load at any layout reads just the chunks it needs: the re-sharding is
torch_dist's (torch_dist.py), with only the keys changed. A directory of Megatron-LM's own
(no `common`) loads its weights, as torch_dist loads Megatron-Core's: optimizer, schedule
and counters start fresh; its `args` give the model configuration (allow-listed
unpickling, megatron_legacy.SAFE_GLOBALS; anything else is refused by name).
"""
import io
import os
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron.checkpointing import collectives, dist_io
from megatron.checkpointing.dist_io import SafeReader
from megatron.checkpointing.formats import Found, RunState
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.mcore_keys import mcore_key
from megatron.checkpointing.megatron_legacy import MEGATRON_VERSION, SAFE_GLOBALS, megatron_args
from megatron.checkpointing.torch_dist import TorchDistFormat, stored_config

COMMON = "common"
MEGATRON_ENTRIES = ("iteration", "checkpoint_version", "args")
"""Megatron-LM's entries beside the model that a directory of its own gives us."""
HEAD_EXTRA_STATE = "model.output_layer._extra_state"
LINEARS = ("linear_", "output_layer", "eh_proj")
"""Megatron-Core modules whose state dict has an `_extra_state` (None without Transformer
Engine's fp8): its linear layers."""


def state_dict_key(global_name: str, cfg):
    """Megatron-Core GPTModel.state_dict()'s name of a parameter (local spec): every layer
    keyed on its own, the norms unfused (mcore_keys.py)."""
    return mcore_key(global_name, stacked=False, mla=True)


class TorchDCPFormat(TorchDistFormat):
    """Megatron-LM's torch_dcp (see the module docstring); torch_dist's machinery."""

    name = "torch_dcp"
    ckpt_format = "torch_dcp"
    naming = staticmethod(state_dict_key)
    prefix = "model."

    def detect(self, directory: str) -> bool:
        return (os.path.isfile(os.path.join(directory, ".metadata"))
                and not dist_io.is_torch_dist(directory))

    def stored_state(self, found: Found) -> Dict[str, Any]:
        common = read_entries(found.directory)
        return dict(common, config=stored_config(common))

    def read_common(self, found: Found, verify: bool) -> dict:
        common = read_entries(found.directory)
        if verify:
            dist_io.verify_checksums(found.directory, required=dist_io.written_here(common))
        found.check_iteration(common.get("iteration"), found.directory)
        return common

    def snapshot(self, root: str, iteration: int, run: RunState) -> dict:
        snapshot = super().snapshot(root, iteration, run)
        if collectives.rank() == 0:
            snapshot["state"]["args"] = megatron_args(
                run.config, run.pstate, iteration, run.consumed_train, run.consumed_valid)
        return snapshot

    def write_files(self, root: str, iteration: Optional[int], state: dict, common: dict,
                    final: Optional[str] = None) -> None:
        """The DCP files alone: `common` (rank 0's) and Megatron-LM's entries inside."""
        state = dict(state, **extra_states(state))
        if collectives.rank() == 0:  # the head's too: a tied model saves no weight there
            state.update({COMMON: to_bytes(common), "iteration": common.get("iteration"),
                          "checkpoint_version": MEGATRON_VERSION, HEAD_EXTRA_STATE: None})
        dist_io.write_iteration(root, iteration, state, None, final=final)


FORMAT = TorchDCPFormat()


def extra_states(state: dict) -> dict:
    """A None `<module>._extra_state` for each linear layer's weight in `state`, as
    Megatron-Core's state dict holds it (its load asks for every key it has)."""
    out = {}
    for key in state:
        module, _, leaf = key.rpartition(".")
        if key.startswith(FORMAT.prefix) and leaf == "weight" and \
                module.rpartition(".")[2].startswith(LINEARS):
            out[module + "._extra_state"] = None
    return out


def to_bytes(common: dict) -> torch.Tensor:
    """torch_dist's common state as a uint8 tensor (DCP keeps it whole, unflattened)."""
    buffer = io.BytesIO()
    torch.save(common, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def read_entries(directory: str) -> dict:
    """Our common state, or for a directory of Megatron-LM's own its `iteration`,
    `checkpoint_version` and `args`; one process, any rank."""
    saved = SafeReader(directory).read_metadata().state_dict_metadata
    if COMMON in saved:
        blob = torch.empty(tuple(saved[COMMON].size), dtype=torch.uint8)
        _load(directory, {COMMON: blob})
        return _unpickle(io.BytesIO(blob.numpy().tobytes()), directory, COMMON)
    entries = {key: None for key in MEGATRON_ENTRIES if key in saved}
    _load(directory, entries)
    return entries


def _unpickle(data, directory: str, key: str):
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{directory}: its {key!r} entry cannot be read as plain data "
                              f"({str(err).strip().splitlines()[0]}); it was not loaded (no "
                              f"code of a checkpoint runs)") from None


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner whose non-tensor entries are unpickled as plain data only."""

    def __init__(self, directory: str):
        super().__init__(flatten_state_dict=False)
        self.directory = directory

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        self.state_dict[key] = _unpickle(value, self.directory, key)


def _load(directory: str, state: dict) -> None:
    """Fill `state` from the DCP checkpoint in `directory`, in this process alone."""
    try:
        dcp.load(state, storage_reader=SafeReader(directory),
                 planner=_PlainDataPlanner(directory), no_dist=True)
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        failures = getattr(err, "failures", {}) or {}
        first = next(iter(failures.values()), (err,))[0] if failures else err
        if isinstance(first, CheckpointError):
            raise first from None
        raise CheckpointError(f"{directory} cannot be read as a torch_dcp checkpoint: "
                              f"{type(first).__name__}: {str(first).strip().splitlines()[0]}"
                              ) from None
