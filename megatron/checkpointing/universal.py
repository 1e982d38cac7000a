"""--universal-checkpoint: load a checkpoint saved at another TP / PP layout by re-sharding it.

Every rank reads all rank files of the checkpoint, merges the tensor-parallel shards into full
tensors and cuts out its own piece for the current layout, with the functions of
reshard.py (in memory, as tools/merge_mp_partitions.py does on disk). Weights, iteration, consumed
samples and the lr schedule carry over; the optimizer state starts fresh (with a notice), since
its shards follow the saved layout. A change of the data-parallel size alone needs no flag.
"""
from typing import Optional

from megatron.checkpointing import reshard
from megatron.checkpointing.experts import check_split as split_problem, split_experts
from megatron.checkpointing.layout import CheckpointError, read_tracker


def resharded_state(root: str, pstate, num_chunks: int) -> Optional[dict]:
    """This rank's state re-cut from the saved layout; None when there is no checkpoint or
    it was saved with the current TP / PP / virtual-pipeline layout."""
    if read_tracker(root) is None:
        return None
    try:
        source = reshard.read_source(root)
        first = source.states[min(source.states)]
        ep = getattr(pstate, "ep_size", 1)
        saved = (source.tp, source.pp, len(reshard.model_chunks(first)))
        if saved == (pstate.tp_size, pstate.pp_size, num_chunks) and source.ep == ep:
            return None
        if num_chunks > 1:
            raise CheckpointError("--universal-checkpoint re-shards into one model chunk per "
                                  "stage; drop --num-layers-per-virtual-pipeline-stage")
        flat = reshard.resplit(source, pstate.tp_size, pstate.pp_size)
    except reshard.ReshardError as err:
        raise CheckpointError(f"--universal-checkpoint cannot re-shard {root}: {err}") from None
    mine = flat[(pstate.tp_rank, pstate.pp_rank)]
    problem = split_problem(mine, ep, source.sharding)
    if problem:
        raise CheckpointError(f"--universal-checkpoint cannot re-shard {root}: {problem}")
    mine = split_experts(mine, ep, source.sharding)[getattr(pstate, "ep_rank", 0)]
    state = reshard.target_state(first, mine, pstate.tp_size, pstate.pp_size, source.sharding, ep)
    if "opt_param_scheduler" in first:
        state["opt_param_scheduler"] = first["opt_param_scheduler"]
    state["_release"] = source.release
    state["resharded_from"] = saved
    return state
