"""Everything that knows checkpoint formats.

    io.py               durable files: temp name + fsync + rename, sha256 sidecars, ENOSPC
    layout.py           our layout (iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt): save, load, tracker
    megatron_legacy.py  Megatron-LM / Megatron-DeepSpeed files, read and written in their format
    reshard.py          TP / PP re-sharding from the saved sharding metadata
    universal.py        --universal-checkpoint: re-shard at load
    loading.py          checkpoint set-up shared by the entry points (stored config, inference models)
    hf/                 Hugging Face <-> ours, one mapping per architecture family

Tools (tools/merge_mp_partitions.py, tools/convert_checkpoint.py) are command lines over these.
"""
