"""Everything that knows checkpoint formats.

    io.py               durable files: temp name + fsync + rename, sha256 sidecars, ENOSPC
    layout.py           our layout (iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt): save, load, tracker
    megatron_legacy.py  Megatron-LM / Megatron-DeepSpeed files, read and written in their format
    reshard.py          TP / PP re-sharding from the saved sharding metadata
    universal.py        --universal-checkpoint: re-shard at load
    loading.py          checkpoint set-up shared by the entry points (stored config, inference models)
    hf/                 Hugging Face <-> ours, one mapping per architecture family
    torch_dist.py       --ckpt-format torch_dist (Megatron-Core's, through torch.distributed.checkpoint):
                        save, load at any layout, checksums; dist_state.py (this rank's model and
                        optimizer tensors), dist_regions.py (their global offsets), mcore_keys.py
                        (Megatron-Core's keys), async_save.py (--async-save), dist_convert.py
                        (whole-model reads / writes: HF export, torch <-> torch_dist)

Tools (tools/merge_mp_partitions.py, tools/convert_checkpoint.py) are command lines over these.
"""
