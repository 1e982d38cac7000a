"""Megatron-LM's and Megatron-DeepSpeed's own per-rank files (checkpoint versions 0 to 3.0),
read where our torch format is asked for (`--ckpt-format torch` is Megatron-LM's name for
them too).

Their layout is ours (model_file.py); what differs is inside each file, and
megatron_legacy.py turns it into our state when it is read: QKV rows of versions < 2.0
reordered, old key names mapped, the counters and the model configuration taken from
`args`, the RNG entry and the optimizer's fp32 copies put in our form. Loading, re-sharding
and the whole-model reader are therefore the torch format's. Saving is the torch format's
too: its files carry Megatron-LM's entries, so Megatron-LM resumes them.
"""
from megatron.checkpointing import megatron_legacy
from megatron.checkpointing.formats import RunState
from megatron.checkpointing.io import CheckpointError, load_file
from megatron.checkpointing.model_file import first_rank_file
from megatron.checkpointing.torch_format import TorchFormat


class MegatronLMFormat(TorchFormat):
    name = "megatron-lm"
    ckpt_format = "torch"

    def detect(self, directory: str) -> bool:
        path = first_rank_file(directory)
        if path is None:
            return False
        state = load_file(path, verify=False, mmap=True)
        return isinstance(state, dict) and megatron_legacy.is_megatron_file(state)

    def snapshot(self, root: str, iteration: int, run: RunState):
        raise CheckpointError("Megatron-LM's own files are read, not written: save with "
                              "--ckpt-format torch, whose files Megatron-LM loads")


FORMAT = MegatronLMFormat()
