"""--step-batch-size-schedule: the global batch size as a step function of consumed tokens.

"0:16 2.4B:320 ..." means 16 samples per step from the start, 320 once 2.4e9 tokens have
been consumed (at the first step that starts at or past the threshold), and so on. The
batch depends only on the consumed samples, so a resumed run continues on the same
schedule.
"""
import re
from typing import List, Tuple

from megatron.config.errors import ConfigError

Schedule = List[Tuple[int, int]]
_SUFFIX = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "G": 10 ** 9, "T": 10 ** 12}
_ENTRY = re.compile(r"^(\d+(?:\.\d+)?(?:[eE]\d+)?)([KMBGT]?):(\d+)$")


def parse_step_schedule(text: str) -> Schedule:
    """[(tokens, global batch)] from "TOKENS:BATCH ..." (TOKENS may end in K, M, B or T);
    the thresholds start at 0 and increase. Bad input is a one-line ConfigError."""
    entries = []
    for item in re.split(r"[\s,]+", text.strip()):
        match = _ENTRY.match(item.upper())
        if match is None:
            raise ConfigError(f"--step-batch-size-schedule entry {item!r} is not TOKENS:BATCH "
                              f"(e.g. 0:16 2.4B:320)")
        tokens = round(float(match.group(1)) * _SUFFIX[match.group(2)])
        entries.append((tokens, int(match.group(3))))
    thresholds = [t for t, _ in entries]
    if thresholds[0] != 0 or thresholds != sorted(set(thresholds)):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: the token thresholds must start "
                          f"at 0 and increase")
    if any(batch <= 0 for _, batch in entries):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: batch sizes must be positive")
    return entries


def batch_at(schedule: Schedule, consumed_tokens: int) -> int:
    """The global batch of a step that starts after `consumed_tokens` tokens."""
    return [batch for tokens, batch in schedule if tokens <= consumed_tokens][-1]
