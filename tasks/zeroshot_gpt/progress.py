"""Progress lines of a long evaluation, one every `--log-interval` micro batches.

    > evaluated batches: 20/7676 | tokens per second: 1.8432E+03 | running avg loss: 3.1415E+00 |

Counts are this data-parallel rank's micro batches; tokens per second counts the
input tokens of every data-parallel rank. The running value is the loss per
scored label (WIKITEXT103) or the accuracy (LAMBADA) over the batches so far.
"""
import time

import torch

from megatron.training.trainer import print_rank_last


class Progress:
    """Fed by the last pipeline stage after each micro batch; prints on the last rank."""

    def __init__(self, total_batches: int, interval: int, dp_size: int, running_name: str):
        self.total_batches = total_batches
        self.interval = max(1, interval)
        self.dp_size = dp_size
        self.running_name = running_name
        self.start = time.perf_counter()
        self.batches = 0
        self.tokens = 0
        self.score = self.count = 0.0  # device tensors after the first batch: synced when printed

    def update(self, num_tokens: int, score: torch.Tensor, count: torch.Tensor) -> None:
        """One micro batch of `num_tokens` input tokens scoring `score` over `count` items."""
        self.batches += 1
        self.tokens += num_tokens * self.dp_size
        self.score = self.score + score.detach().double()
        self.count = self.count + count.detach().double()
        if self.batches % self.interval == 0:
            print_rank_last(self.line())

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        running = float(self.score) / max(float(self.count), 1.0)
        return (f" > evaluated batches: {self.batches}/{self.total_batches} | "
                f"tokens per second: {self.tokens / elapsed:.4E} | "
                f"running {self.running_name}: {running:.4E} |")
