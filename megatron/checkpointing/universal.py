"""--universal-checkpoint: load a checkpoint saved at another TP / PP / EP layout by re-sharding
it at load, whatever its format.

Every rank reads the whole model through the format's `read_model` (full tensors), and cuts
out its own piece for the current layout with reshard.py's `cut` (in memory, as
tools/merge_mp_partitions.py does on disk). Weights, iteration, consumed samples and the lr
schedule carry over; the optimizer state starts fresh (with a notice), since its shards
follow the saved layout. A checkpoint saved at this run's layout loads as its format loads
it, optimizer included. The inference entry points re-shard the same way without the flag
(`inference=True`: the errors say how to avoid it). Formats that re-shard at load themselves
(torch_dist) never come here.
"""
from typing import Any, Dict

from megatron.checkpointing import reshard
from megatron.checkpointing.experts import check_split, split_experts
from megatron.checkpointing.formats import Counters, Found, RunState
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.model_file import load_into_models, to_megatron_layout


def saved_layout(stored: Dict[str, Any], run: RunState) -> tuple:
    """(TP, PP, virtual chunks, EP, expert TP, pipeline split) a checkpoint's stored state
    says it was saved at (a split it does not record, saved before it was: the run's)."""
    saved = stored.get("parallel") or {}
    tp = int(saved.get("tensor_model_parallel_size", 1))
    return (tp, int(saved.get("pipeline_model_parallel_size", 1)),
            int(saved.get("virtual_pipeline_model_parallel_size", 1)),
            int(saved.get("expert_model_parallel_size", 1)),
            int(saved.get("expert_tensor_parallel_size") or tp),
            saved.get("pipeline_layout", run.pipeline_split()))


def run_layout(run: RunState) -> tuple:
    p = run.pstate
    return p.tp_size, p.pp_size, len(run.models), p.ep_size, p.etp_size, run.pipeline_split()


def _refusal(root: str, problem: str, pstate, inference: bool) -> CheckpointError:
    if not inference:
        return CheckpointError(f"--universal-checkpoint cannot re-shard {root}: {problem}")
    return CheckpointError(
        f"loading {root} for inference re-shards it in memory to TP {pstate.tp_size} x PP "
        f"{pstate.pp_size}, which fails: {problem}; run with the checkpoint's own "
        f"--tensor-model-parallel-size / --pipeline-model-parallel-size, or re-shard it on "
        f"disk first with tools/merge_mp_partitions.py")


def load(found: Found, run: RunState, inference: bool = False) -> Counters:
    """Load `found` at this run's layout, re-sharding it when it was saved at another."""
    fmt, pstate = found.format, run.pstate
    saved = saved_layout(fmt.stored_state(found), run)
    if saved == run_layout(run):
        return fmt.load(found, run)
    try:
        if len(run.models) > 1:
            raise reshard.ReshardError("re-sharding makes one model chunk per stage; drop "
                                       "--num-layers-per-virtual-pipeline-stage")
        full, stored = fmt.read_model(found)
        mine = _this_rank(full, stored, pstate, run.config.pipeline_layout())
    except reshard.ReshardError as err:
        raise _refusal(found.root, str(err), pstate, inference) from None
    _load_weights(run, mine, found.root)
    if pstate.rank == 0:
        before, after = _layout_words(saved, run_layout(run))
        print(f" re-sharding {found.root} in memory from {before} to {after}" if inference else
              f" > --universal-checkpoint: re-sharded {found.root} from {before} to {after}; "
              f"the optimizer state starts fresh", flush=True)
    return _counters(found, run, stored)


def _layout_words(saved: tuple, now: tuple) -> tuple:
    """("TP 2 x PP 1", "TP 1 x PP 1") of two run_layout tuples, with EP (and ETP) where
    either side has experts split (ETP where it is not TP)."""
    def words(layout, ep: bool, etp: bool) -> str:
        tp, pp, _, experts, expert_tp, _ = layout
        parts = [f"TP {tp}", f"PP {pp}"] + ([f"EP {experts}"] if ep else [])
        return " x ".join(parts + ([f"ETP {expert_tp}"] if etp else []))
    ep = saved[3] > 1 or now[3] > 1
    etp = saved[4] != saved[0] or now[4] != now[0]
    return words(saved, ep, etp), words(now, ep, etp)


def _this_rank(full, stored: dict, pstate, layout):
    """This rank's parameters (local names) cut from the whole model, its layers where the
    run's pipeline `layout` places them."""
    cells = reshard.cut(full, stored, pstate.tp_size, pstate.pp_size, 1, pstate.etp_size,
                        layout)
    mine = cells[(pstate.tp_rank, pstate.pp_rank)]
    sharding = reshard.Sharding(stored.get("sharding") or {})
    problem = check_split(mine, pstate.ep_size, sharding)
    if problem:
        raise reshard.ReshardError(problem)
    return split_experts(mine, pstate.ep_size, sharding)[pstate.ep_rank]


def _load_weights(run: RunState, flat, root: str) -> None:
    load_into_models({"model": to_megatron_layout(flat)}, run.models, root)
    if run.optimizer is not None:
        run.optimizer.reload_model_params()


def _counters(found: Found, run: RunState, stored: dict) -> Counters:
    """The stored counters and lr schedule of a re-sharded checkpoint."""
    ckpt = run.config.checkpoint
    iteration = int(stored.get("iteration", found.iteration))
    if run.optimizer is None:
        return iteration, 0, 0
    if ckpt.finetune or found.release:
        return 0, 0, 0
    if not ckpt.no_load_optim and "opt_param_scheduler" in stored:
        run.scheduler.load_state_dict(stored["opt_param_scheduler"])
    return (iteration, int(stored.get("consumed_train_samples", 0)),
            int(stored.get("consumed_valid_samples", 0)))
