"""Configuration of data, tokenizer and checkpoints."""
from dataclasses import dataclass, field
from typing import List, Optional

from megatron.config.data_paths import parse_data_prefix, parse_split_weights
from megatron.config.errors import ConfigError, require


@dataclass
class DataConfig:
    data_path: List[str] = field(default_factory=list)
    """Prefix, or weight prefix weight prefix ... (--data-path)."""
    split: str = "969,30,1"
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_name_or_path: Optional[str] = None
    tokenizer_model: Optional[str] = None
    """SentencePiece / tiktoken model file, or HuggingFaceTokenizer's directory (--tokenizer-model)."""
    vocab_size: Optional[int] = None
    """Vocabulary size for the NullTokenizer."""
    data_cache_path: Optional[str] = None
    dataloader_type: str = "single"
    num_workers: int = 2
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    train_weighted_split_paths: Optional[List[str]] = None
    """Megatron-DeepSpeed's per-split blend "NAME: W START:END PREFIX, ..." (and valid/test)."""
    valid_weighted_split_paths: Optional[List[str]] = None
    test_weighted_split_paths: Optional[List[str]] = None
    mock_data: bool = False
    """Synthetic random tokens instead of --data-path (--mock-data)."""
    separate_last_epoch_threshold: float = 0.80
    """The last epoch is shuffled apart when it is used for less than this fraction of its
    samples: 0.80 as Megatron-LM, 0.95 as Megatron-DeepSpeed."""

    def __post_init__(self):
        require(0.0 <= self.separate_last_epoch_threshold <= 1.0,
                f"--separate-last-epoch-threshold must be in [0, 1], "
                f"got {self.separate_last_epoch_threshold}")
        require(self.dataloader_type in ("single", "cyclic"),
                f"--dataloader-type {self.dataloader_type!r} is not single or cyclic")
        require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        require(self.vocab_size is None or self.vocab_size > 0,
                f"--vocab-size must be positive, got {self.vocab_size}")
        self._check_split_and_paths()

    def _check_split_and_paths(self):
        """--split and --data-path parse as the datasets will parse them."""
        try:
            parse_split_weights(self.split)
            if self.data_path:
                parse_data_prefix(list(self.data_path))
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    verify_checkpoint: bool = True
    """Check each file's checksum at --load (--no-verify-checkpoint skips)."""
    universal_checkpoint: bool = False
    """Load a checkpoint saved at another TP / PP layout by re-sharding it on load."""
    ckpt_format: str = "torch"
    """The format saves write (megatron.checkpointing.api.FORMATS): torch (one file per
    model-parallel rank), torch_dist (torch.distributed.checkpoint shards in Megatron-Core's
    layout, re-sharded to any layout at load) or torch_dcp (Megatron-LM's: one
    torch.distributed.checkpoint of the model's state dict, re-sharded alike)."""
    auto_detect_ckpt_format: bool = False
    """At --load, read the format found on disk instead of --ckpt-format."""
    async_save: bool = False
    """Write checkpoints in the background from a CPU copy (any format)."""

    def __post_init__(self):
        require(self.save_interval is None or self.save_interval > 0,
                f"--save-interval must be positive, got {self.save_interval}")
