"""Everything that knows checkpoint formats. Enter through api.py.

    api.py              the front door: detect, save, load, stored state, whole-model read /
                        write, convert; FORMATS, the registry of formats
    formats.py          the protocol every format satisfies (CheckpointFormat), and what it is
                        given (RunState) and returns (Found, Target, Counters)
  the formats (one module each):
    torch_format.py     --ckpt-format torch: iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt
    megatron_lm.py      Megatron-LM's / Megatron-DeepSpeed's own files of that layout (read)
    torch_dist.py       --ckpt-format torch_dist, Megatron-Core's (torch.distributed.checkpoint)
    torch_dcp.py        --ckpt-format torch_dcp, Megatron-LM's plain DCP checkpoint of the
                        model's state dict (torch_dist's machinery, other keys)
  wrappers any format takes:
    universal.py        --universal-checkpoint: re-shard at load from the whole model
    async_save.py       --async-save: the format's write in a background writer process
  what the formats share:
    tracker.py          latest_checkpointed_iteration.txt and iteration directories
    io.py               durable files: temp name + fsync + rename, sha256 sidecars, ENOSPC
    collectives.py      barriers and gathers that also run in one plain process; `agreed`:
                        a failure on one rank raised on every rank (no rank left in a barrier)
    rng.py              the RNG state a checkpoint carries
    model_file.py       one rank's model_optim_rng.pt: paths, Megatron's nested layout, checks
    finite.py           nan/inf refused at load: weights and optimizer state, named
    megatron_legacy.py  Megatron-LM files read and written in their format (versions 0 to 3)
    reshard.py          whole models from per-rank files and cut for another TP / PP / EP
    experts.py          expert parallelism in per-rank files (EP merge / split, expert TP)
    dist_io.py          a DCP directory's files: safe metadata reader, checksums, publishing
    dist_state.py       this rank's model and optimizer tensors as DCP ShardedTensors;
                        dist_regions.py (their global offsets), mcore_keys.py (Megatron-Core's keys)
    lock.py             one run at a time per --save directory
    portable.py         checkpoint-relative file references (a moved checkpoint still works)
  conversion families:
    hf/                 Hugging Face <-> ours, one mapping per architecture family
    fairseq/            fairseq <-> ours

Tools (tools/merge_mp_partitions.py, tools/convert_checkpoint.py) are command lines over these.
"""
