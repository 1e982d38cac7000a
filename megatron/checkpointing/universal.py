"""--universal-checkpoint: load a checkpoint saved at another TP / PP layout by re-sharding it.

Every rank reads all rank files of the checkpoint, merges the tensor-parallel shards into full
tensors and cuts out its own piece for the current layout, with the functions of
reshard.py (in memory, as tools/merge_mp_partitions.py does on disk). Weights, iteration, consumed
samples and the lr schedule carry over; the optimizer state starts fresh (with a notice), since
its shards follow the saved layout. A change of the data-parallel size alone needs no flag.
"""
from typing import Optional

from megatron.checkpointing import reshard
from megatron.checkpointing.experts import (check_split as split_problem, recut_expert_tp,
                                            split_experts)
from megatron.checkpointing.layout import CheckpointError, read_tracker


def _refusal(root: str, problem: str, pstate, inference: bool) -> CheckpointError:
    if not inference:
        return CheckpointError(f"--universal-checkpoint cannot re-shard {root}: {problem}")
    return CheckpointError(
        f"loading {root} for inference re-shards it in memory to TP {pstate.tp_size} x PP "
        f"{pstate.pp_size}, which fails: {problem}; run with the checkpoint's own "
        f"--tensor-model-parallel-size / --pipeline-model-parallel-size, or re-shard it on "
        f"disk first with tools/merge_mp_partitions.py")


def resharded_state(root: str, pstate, num_chunks: int,
                    inference: bool = False) -> Optional[dict]:
    """This rank's state re-cut from the saved layout; None when there is no checkpoint or
    it was saved with the current TP / PP / virtual-pipeline layout. `inference`: for the
    inference loaders, which re-shard without --universal-checkpoint (the errors say so)."""
    if read_tracker(root) is None:
        return None
    try:
        source = reshard.read_source(root)
        first = source.states[min(source.states)]
        ep = getattr(pstate, "ep_size", 1)
        etp = pstate.etp_size
        saved = (source.tp, source.pp, len(reshard.model_chunks(first)))
        if saved == (pstate.tp_size, pstate.pp_size, num_chunks) and source.ep == ep and \
                (source.etp or source.tp) == etp:
            return None
        if num_chunks > 1:
            raise reshard.ReshardError("re-sharding makes one model chunk per stage; drop "
                                       "--num-layers-per-virtual-pipeline-stage")
        flat = recut_expert_tp(reshard.resplit(source, pstate.tp_size, pstate.pp_size),
                               pstate.tp_size, pstate.tp_size, etp, source.sharding)
    except reshard.ReshardError as err:
        raise _refusal(root, str(err), pstate, inference) from None
    mine = flat[(pstate.tp_rank, pstate.pp_rank)]
    problem = split_problem(mine, ep, source.sharding)
    if problem:
        raise _refusal(root, problem, pstate, inference)
    mine = split_experts(mine, ep, source.sharding)[getattr(pstate, "ep_rank", 0)]
    state = reshard.target_state(first, mine, pstate.tp_size, pstate.pp_size, source.sharding, ep,
                                 etp)
    if "opt_param_scheduler" in first:
        state["opt_param_scheduler"] = first["opt_param_scheduler"]
    state["_release"] = source.release
    state["resharded_from"] = saved
    return state
