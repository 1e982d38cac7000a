"""Pretrain a GPT: `python pretrain_gpt.py ...`, `torchrun --nproc_per_node N pretrain_gpt.py ...`
or, one task per rank, `srun python pretrain_gpt.py ...` (SLURM_* read by launch_env)."""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.arguments import build_parser, fail, parse_args  # noqa: E402
from megatron.config import ConfigError  # noqa: E402
from megatron.data.batch import gpt_batch  # noqa: E402
from megatron.data.gpt_dataset import build_train_valid_test_datasets  # noqa: E402
from megatron.data.indexed_dataset import IndexedDatasetError  # noqa: E402
from megatron.data.mock_dataset import build_mock_datasets  # noqa: E402
from megatron.data.weighted_split import weighted_split_datasets  # noqa: E402
from megatron.data.sample_record import record_path  # noqa: E402
from megatron.data.samplers import build_pretraining_data_loader, cyclic_iter  # noqa: E402
from megatron.model import GPTModel  # noqa: E402
from megatron.model.context_parallel import split_batch_for_cp  # noqa: E402
from megatron.mpu.mappings import all_reduce, group_size  # noqa: E402
from megatron.training.checkpoint_setup import build_tokenizer_and_vocab, stored_defaults  # noqa: E402
from megatron.checkpointing import api  # noqa: E402
from megatron.checkpointing.io import CheckpointError  # noqa: E402
from megatron.checkpointing.portable import carry_origin  # noqa: E402
from megatron.training.initialize import initialize_distributed  # noqa: E402
from megatron.training.launch_env import apply_launcher_environment  # noqa: E402
from megatron.training.pretrain import check_run_paths, held_save_lock, pretrain  # noqa: E402
from megatron.training.run_guard import RUN_FAILURES, exit_on_run_failure  # noqa: E402
from megatron.training.trainer import print_rank_0, total_iterations  # noqa: E402

REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
            "--max-position-embeddings")


def model_provider(config, tp_group, vocab_size=None, expert_groups=None, *, cfg, **chunk):
    """The GPT stage of the spec `cfg` (megatron.training.parallelize.chunk_config); with
    `vocab_size` (the real vocabulary rows) the padding rows never count in the loss (unless
    --no-mask-vocab-padding)."""
    limit = vocab_size if config.model.mask_vocab_padding else None
    return GPTModel(cfg, tp_group=tp_group, vocab_limit=limit, expert_groups=expert_groups,
                    **chunk)


def loss_func(loss_mask, dp_group, losses, cp_group=None):
    """Mean loss over the micro batch's unmasked tokens; reported averaged over DP. Under
    context parallelism each CP rank's part is its tokens' loss sum over the whole
    sequence's token count (the parts sum to the loss, and so do their gradients)."""
    count = all_reduce(loss_mask.sum(), cp_group)
    loss = (losses.float() * loss_mask).sum() / count
    reported = all_reduce(all_reduce(loss.detach().clone(), cp_group), dp_group)
    return loss, {"lm loss": reported / group_size(dp_group)}


def forward_step(config, eod, pstate, device, data_iterator, model):
    d = config.data
    batch = gpt_batch(next(data_iterator), eod, device, d.reset_position_ids,
                      d.reset_attention_mask, d.eod_mask_loss)
    tokens, labels, loss_mask, mask, position_ids = split_batch_for_cp(
        batch, pstate.cp_rank, pstate.cp_size)
    output = model(tokens, position_ids, mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask, pstate.dp_group, cp_group=pstate.cp_group)


def split_sample_counts(config):
    t = config.training
    train_iters = total_iterations(config)
    train = t.train_samples if t.train_samples is not None else train_iters * t.global_batch_size
    evals = (train_iters // t.eval_interval + 1) * t.eval_iters
    return train, evals * t.global_batch_size, t.eval_iters * t.global_batch_size


def build_datasets(config, vocab_size):
    """(train, valid, test) from --data-path, or synthetic ones with --mock-data."""
    if config.data.mock_data:
        return build_mock_datasets(split_sample_counts(config), config.model.seq_length,
                                   vocab_size, config.training.seed)
    d = config.data
    per_split = (d.train_weighted_split_paths, d.valid_weighted_split_paths,
                 d.test_weighted_split_paths)
    if any(per_split):
        return weighted_split_datasets(per_split, split_sample_counts(config),
                                       config.model.seq_length, config.training.seed,
                                       d.data_cache_path, d.separate_last_epoch_threshold,
                                       vocab_size)
    if not config.data.data_path:
        fail("--data-path is required: a preprocessed prefix (see tools/preprocess_data.py), "
             "or --mock-data for synthetic tokens")
    return build_train_valid_test_datasets(
        config.data.data_path, config.data.split, split_sample_counts(config),
        config.model.seq_length, config.training.seed, config.data.data_cache_path, vocab_size,
        separate_last_epoch_threshold=config.data.separate_last_epoch_threshold)


def data_provider(config, pstate, vocab_size, consumed_train, consumed_valid):
    """(train, valid, test) iterators; a split of several named groups is a dict of them."""
    train_ds, valid_ds, test_ds = build_datasets(config, vocab_size)
    loader = partial(build_pretraining_data_loader, micro_batch_size=config.training.micro_batch_size,
                     data_parallel_rank=pstate.dp_rank, data_parallel_size=pstate.dp_size,
                     dataloader_type=config.data.dataloader_type, num_workers=config.data.num_workers,
                     seed=config.training.seed)
    train = loader(train_ds, consumed_train, record_to=record_path())
    cyclic = config.data.dataloader_type == "cyclic"

    def evaluation(dataset, consumed):
        if isinstance(dataset, dict):
            return {name: evaluation(d, consumed) for name, d in dataset.items()}
        data = loader(dataset, consumed)
        return None if data is None else iter(cyclic_iter(data))
    return (None if train is None else iter(cyclic_iter(train) if cyclic else train),
            evaluation(valid_ds, consumed_valid), evaluation(test_ds, 0))


def real_vocab_rows(config, tokenizer) -> int:
    """Rows of the vocabulary that are not padding: the tokenizer's ids, or the converted
    model's rows when it has more (transformers' loss counts all of them)."""
    return max(tokenizer.vocab_size, (config.hf or {}).get("vocab_rows") or 0)


def build_pretrain_parser():
    """Our flags, with --tokenizer-type defaulting to GPT2BPETokenizer as in both Megatrons."""
    parser = build_parser()
    parser.set_defaults(**{"data.tokenizer_type": "GPT2BPETokenizer"})
    return parser


def setup(argv=None):
    """Parse flags and build the tokenizer; every problem here is one line and exit 2."""
    # With --load, the checkpoint's model and tokenizer are the defaults; its embedding has
    # the checkpoint's padded vocabulary (it may be re-sharded, padded for another TP size).
    parser = build_pretrain_parser()
    stored = stored_defaults(parser, argv)
    config, _ = parse_args(argv, parser=parser, required=REQUIRED)
    tokenizer = build_tokenizer_and_vocab(config, stored)
    if stored:
        root = api.found_or_error(config.checkpoint.load).root  # also for --load DIR/iter_N
        carry_origin(config, stored, root, int(os.environ.get("RANK", "0")))
    return config, tokenizer


def main(argv=None):
    """Train; a bad checkpoint, dataset or setting ends the run with one line and exit 2."""
    try:
        apply_launcher_environment()  # srun / mpirun without torchrun: ranks from their variables
        return _run(argv)
    except (CheckpointError, ConfigError, IndexedDatasetError, FileNotFoundError,
            PermissionError) as err:
        fail(str(err), agreed=getattr(err, "agreed", False),
             per_host=getattr(err, "per_host", False))
    except RUN_FAILURES as err:
        exit_on_run_failure(err)


def _run(argv):
    config, tokenizer = setup(argv)
    check_run_paths(config)
    pstate, device = initialize_distributed(config)
    with held_save_lock(config):
        if config.training.fp16 and device.type == "cpu":
            print_rank_0(" WARNING: --fp16 on a CPU runs 7-10x slower than fp32 (no fp16 matmul "
                         "kernels); use --bf16 or fp32")
        print_rank_0(f" > padded vocab (size: {tokenizer.vocab_size}) with "
                     f"{config.model.padded_vocab_size - tokenizer.vocab_size} dummy tokens "
                     f"(new size: {config.model.padded_vocab_size})")
        return pretrain(config, pstate, device,
                        partial(model_provider, config, pstate.tp_group,
                                real_vocab_rows(config, tokenizer),
                                expert_groups=pstate.expert_groups()),
                        partial(data_provider, config, pstate, tokenizer.vocab_size),
                        partial(forward_step, config, tokenizer.eod, pstate, device))


if __name__ == "__main__":
    main()
