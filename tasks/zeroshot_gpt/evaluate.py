"""Run the zero-shot tasks over any parallel layout and report Megatron's metrics.

Samples are dealt round-robin to the data-parallel ranks (padded with empty
samples so every rank runs the same number of micro batches); each micro batch
goes through the pipeline schedule forward-only, so tensor, pipeline and
interleaved layouts all work. The last stage scores: the summed loss of the
scored labels (WIKITEXT103) or the number of passages whose last word is
predicted exactly (LAMBADA); sums are all-reduced over data-parallel ranks and
broadcast over the pipeline, so every rank returns the same result.
"""
import math
from functools import partial
from typing import Dict, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.data.batch import ltor_masks_and_position_ids
from megatron.mpu.mappings import all_reduce, group_size
from megatron.pipeline.executor import forward_backward
from megatron.training.parallelize import pipeline_communicator
from megatron.training.trainer import ReplayIterators
from tasks.zeroshot_gpt.progress import Progress

WIKITEXT = "WIKITEXT103"
LAMBADA = "LAMBADA"
TASKS = (WIKITEXT, LAMBADA)


def num_micro_batches(num_samples: int, micro: int, dp_size: int, multiple: int = 1) -> int:
    """Micro batches per DP rank covering every sample (a multiple of `multiple`)."""
    per_rank = math.ceil(num_samples / dp_size)
    count = max(1, math.ceil(per_rank / micro))
    return math.ceil(count / multiple) * multiple


def micro_batches(dataset, count: int, micro: int, dp_rank: int, dp_size: int, eod: int,
                  device, data_cfg) -> Iterator[dict]:
    """This DP rank's micro batches; sample k of the rank is dataset[dp_rank + k * dp_size]."""
    seq_plus_one = len(dataset[0][0])
    for b in range(count):
        tokens = np.full((micro, seq_plus_one), eod, dtype=np.int64)
        mask = np.zeros((micro, seq_plus_one - 1), dtype=np.float32)
        valid = np.zeros(micro, dtype=np.float32)
        for i in range(micro):
            index = dp_rank + (b * micro + i) * dp_size
            if index < len(dataset):
                tokens[i], mask[i] = dataset[index]
                valid[i] = 1.0
        yield _to_batch(torch.from_numpy(tokens).to(device), torch.from_numpy(mask).to(device),
                        torch.from_numpy(valid).to(device), eod, data_cfg)


def _to_batch(text, loss_mask, valid, eod, data_cfg) -> dict:
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    _, attention_mask, position_ids = ltor_masks_and_position_ids(
        tokens, eod, data_cfg.reset_position_ids, data_cfg.reset_attention_mask, False)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "valid": valid,
            "attention_mask": attention_mask, "position_ids": position_ids}


def score(task: str, batch: dict, output: torch.Tensor, vocab_size: Optional[int] = None,
          progress: Optional[Progress] = None):
    """(score tensor, report) of one micro batch from the last stage's output.

    LAMBADA's greedy prediction never picks a vocabulary-padding id (>= vocab_size);
    models loaded for inference mask those ids already (`vocab_limit`).
    """
    if task == WIKITEXT:
        total = (output.float() * batch["loss_mask"]).sum()
        count = batch["loss_mask"].sum()
    else:
        predicted = output[..., :vocab_size].argmax(dim=-1)
        correct = (predicted == batch["labels"]) | (batch["loss_mask"] == 0)
        total = (correct.all(dim=-1).float() * batch["valid"]).sum()
        count = batch["valid"].sum()
    if progress is not None:
        progress.update(batch["tokens"].numel(), total, count)
    return total, {"score": total.detach().double()}


def forward_step(task: str, progress: Optional[Progress], data_iterator, model):
    batch = next(data_iterator)
    labels = batch["labels"] if task == WIKITEXT else None
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=labels)
    return output, partial(score, task, batch, progress=progress)


@torch.no_grad()
def evaluate(task: str, dataset, models, config, pstate, device, eod: int,
             log_interval: Optional[int] = None) -> float:
    """Summed score of the task over the whole dataset (identical on every rank).

    The models are loaded with `vocab_limit`, so padding ids never count.
    `log_interval`: print a progress line every that many micro batches.
    """
    micro = config.training.micro_batch_size
    interleaved = len(models) > 1
    count = num_micro_batches(len(dataset), micro, pstate.dp_size,
                              pstate.pp_size if interleaved else 1)
    batches = micro_batches(dataset, count, micro, pstate.dp_rank, pstate.dp_size, eod, device,
                            config.data)
    schedule = "none" if pstate.pp_size == 1 else ("interleaved" if interleaved else "1f1b")
    for model in models:
        model.eval()
    progress = None if log_interval is None else Progress(
        count, log_interval, pstate.dp_size, "avg loss" if task == WIKITEXT else "avg accuracy")
    reports = forward_backward(
        schedule, forward_step=partial(forward_step, task, progress),
        data_iterators=ReplayIterators(batches, len(models)).all(), model_chunks=models,
        num_microbatches=count, comm=pipeline_communicator(config, pstate, device, len(models)),
        pp_rank=pstate.pp_rank, pp_size=pstate.pp_size, forward_only=True)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for report in reports:
        total += report["score"]
    all_reduce(total, pstate.dp_group)
    if group_size(pstate.pp_group) > 1:
        dist.broadcast(total, src=pstate.pp_ranks[-1], group=pstate.pp_group)
    return float(total.item())


def wikitext_metrics(total_loss: float, num_tokenized: int, num_original: int) -> Dict[str, float]:
    """Megatron's numbers: loss per BPE token, and the perplexity per original word."""
    avg_loss = total_loss / (num_tokenized - 1)
    ratio = (num_tokenized - 1) / (num_original - 1)
    return {"avg loss": avg_loss, "ppl": math.exp(min(20.0, avg_loss)),
            "adjusted ppl": math.exp(min(20.0, avg_loss * ratio)), "token ratio": ratio}


def lambada_metrics(correct: float, total: int) -> Dict[str, float]:
    return {"number correct": correct, "total examples": float(total),
            "avg accuracy": correct / total}


def format_metrics(task: str, metrics: Dict[str, float]) -> str:
    """Megatron's result line, character for character (its LAMBADA line has no closing bar)."""
    line = f" validation results on {task} | "
    if task == WIKITEXT:
        return line + (f"avg loss: {metrics['avg loss']:.4E} | ppl: {metrics['ppl']:.4E} | "
                       f"adjusted ppl: {metrics['adjusted ppl']:.4E} | "
                       f"token ratio: {metrics['token ratio']} |")
    return line + (f"number correct: {metrics['number correct']:.4E} | "
                   f"total examples: {metrics['total examples']:.4E} | "
                   f"avg accuracy: {metrics['avg accuracy']:.4E}")
