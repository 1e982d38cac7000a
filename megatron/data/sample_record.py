"""Which training samples each rank draws, for checking that a resumed run repeats and skips
none: `MEGATRON_RECORD_SAMPLES=DIR` makes every rank append, per micro batch it draws, one
line of the sample indices (positions in the global sample stream) to
`DIR/train-samples-rank<RANK>-restart<TORCHELASTIC_RESTART_COUNT>.txt`. Off when unset."""
import glob
import os
import re
from typing import Dict, List, Optional, Tuple

ENV = "MEGATRON_RECORD_SAMPLES"
_NAME = re.compile(r"train-samples-rank(\d+)-restart(\d+)\.txt$")


def record_path() -> Optional[str]:
    directory = os.environ.get(ENV)
    if not directory:
        return None
    rank = os.environ.get("RANK", "0")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return os.path.join(directory, f"train-samples-rank{rank}-restart{restart}.txt")


class RecordedSampler:
    """A batch sampler whose batches are also written to `path`, one line each."""

    def __init__(self, sampler, path: str):
        self.sampler, self.path = sampler, path

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        with open(self.path, "a") as out:
            for batch in self.sampler:
                out.write(" ".join(map(str, batch)) + "\n")
                out.flush()
                yield batch


def read_records(directory) -> Dict[Tuple[int, int], List[List[int]]]:
    """{(restart, rank): the micro batches drawn, in order} of a recorded directory."""
    found = {}
    for path in glob.glob(os.path.join(str(directory), "train-samples-rank*-restart*.txt")):
        rank, restart = map(int, _NAME.search(path).groups())
        with open(path) as f:
            found[(restart, rank)] = [list(map(int, line.split())) for line in f if line.strip()]
    return found
