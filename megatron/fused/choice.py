"""Which path a fused op takes where it has a faster alternative: measured on the machine at
hand, cached on disk, and agreed across ranks.

A *decision* is one op (attention, layer norm, RMSNorm, the head's exp_sum_) for one dtype
and shape bucket (`Decision`: powers of two of the sequence length or the rows, exact
hidden / head sizes). The modes (`--fused-kernels-choice`, default from
`$MEGATRON_FUSED_KERNELS_CHOICE`, else auto):
  auto   time both paths for the decision's shapes on synthetic tensors (forward+backward,
         interleaved, median; `time_pair`) and take the faster (a tie, within TIE_RATIO,
         takes the rule's path); the result is cached;
  ours   our kernel wherever it applies;  plain  the PyTorch path always;
  rule   the fixed per-op rule each op ships (what auto did before it measured; no timing,
         so tests are reproducible).

Cache: `$MEGATRON_KERNEL_CHOICE_CACHE`, else `$XDG_CACHE_HOME/megatron-gpt/kernel-choice.json`
(`~/.cache/...`), one JSON object of records keyed by CPU model, our kernels' ISA, torch's
thread count, op, dtype and bucket (`Decision.key`), published whole (megatron/files.py).
A cache that cannot be written (a read-only home) is said once; choices are then kept in
memory for the process.

Across ranks. Each process measuring its own decision would let two ranks of one job take
different paths (noise decides), and replicated math (layer norms under TP, say) would drift
apart. A collective at first use is not safe either: under pipeline parallelism a stage meets
its first attention while the next stage waits in a p2p receive, and the head exists on the
last stage only, so a broadcast there would hang. So decisions are agreed where every rank is
at the same point of the program: `agree(decisions, group)`, called by every rank after the
model is built (megatron/training/kernel_choices.py lists the decisions the run's shapes
imply). It all-gathers every rank's decisions, rank 0 answers each (its cache, else a
timing) and broadcasts the answers. Under torch.distributed with more than one rank a
decision that was not agreed is never measured: it takes the op's rule, the same on every
rank. A single process measures at first use.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from megatron import files
from megatron.fused import kernels as fused_kernels

MODES = ("auto", "ours", "plain", "rule")
MODE_ENV = "MEGATRON_FUSED_KERNELS_CHOICE"
CACHE_ENV = "MEGATRON_KERNEL_CHOICE_CACHE"
CACHE_VERSION = 1


class KernelChoiceError(ValueError):
    """A mode or decision that does not exist."""


@dataclass(frozen=True)
class Decision:
    """One op at one dtype and shape bucket; `dims` ((name, value) pairs) are what the op's
    timing (`MEASURES[op]`) builds its synthetic tensors from."""
    op: str
    dtype: str
    dims: tuple

    def key(self) -> str:
        shape = " ".join(f"{name}{value}" for name, value in self.dims)
        return (f"{fused_kernels.cpu_model()} | {fused_kernels.cpu_isa()} | kernels "
                f"{fused_kernels.cpu_kernels_version()} | threads {torch.get_num_threads()} | "
                f"{self.op} | {self.dtype} | {shape}")


def bucket(n: int) -> int:
    """The power of two at or above n (shape buckets: 1000 and 1024 share a decision)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# Each op registers (measure, rule, name of the plain path, name of ours): measure(dims, dtype)
# -> (ours, plain) zero-argument steps (forward+backward); rule(dims, dtype) -> bool;
# plain(dims) -> str, ours(dims) -> str.
MEASURES: dict[str, tuple[Callable, Callable, Callable, Callable]] = {}


def register(op: str, measure: Callable, rule: Callable, plain: Callable,
             ours: Callable = lambda dims: "our kernel") -> None:
    MEASURES[op] = (measure, rule, plain, ours)


class _State:
    def __init__(self):
        self.mode = None          # None: $MEGATRON_FUSED_KERNELS_CHOICE, else auto
        self.table = {}           # key -> record, this process's answers
        self.disk = None          # the cache file's records, read once
        self.cache_failed = None  # why the cache could not be written, once said
        self.announced = set()    # decisions (and modes) whose line has been printed


_STATE = _State()


def reset() -> None:
    """Forget every answer and the cache file's contents read so far (tests)."""
    global _STATE
    _STATE = _State()


def set_mode(mode: str | None) -> None:
    """auto | ours | plain | rule for every decision of this process; None: the env var's."""
    if mode is not None and mode not in MODES:
        raise KernelChoiceError(f"--fused-kernels-choice {mode!r} is not one of {MODES}")
    _STATE.mode = mode


def mode() -> str:
    value = _STATE.mode or os.environ.get(MODE_ENV, "") or "auto"
    if value not in MODES:
        raise KernelChoiceError(f"{MODE_ENV}={value!r} is not one of {MODES}")
    return value


def cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-gpt" / "kernel-choice.json"


# A timing sample repeats a step until it lasts this long; the whole timing of one decision
# aims at TIMING_BUDGET_S (at least MIN_REPEATS interleaved samples of each path, at most
# MAX_REPEATS), so a short shape costs ~0.1 s once and a long one a few of its steps.
MIN_SAMPLE_S = 0.002
TIMING_BUDGET_S = 0.1
MIN_REPEATS, MAX_REPEATS = 3, 9

CLOSE_RATIO = 1.15
"""Medians within this factor of each other after the first rounds take rounds up to
MAX_REPEATS: three samples of a long shape (seconds each) are within the drift of a shared
machine (a Zen 4 once measured bfloat16 s8192's dot products 480 ms against the microkernels'
437 ms in three rounds, where bench_fused's longer timing read 394 ms against 435 ms)."""

TIE_RATIO = 1.05
"""Medians within this factor of each other are a tie: the op's rule takes it, so that noise
does not flip a choice between machines or reruns that differ by nothing else."""


def _sample(fn: Callable, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


CLEAR_WIN_S, CLEAR_WIN_RATIO = 1.0, 3.0
"""A warm-up call of CLEAR_WIN_S or more that is CLEAR_WIN_RATIO times the other's decides
alone (SDPA with a sliding window's mask in bfloat16 takes seconds per call where our kernel
takes tens of milliseconds: the rounds would take minutes)."""


def time_pair(ours: Callable, plain: Callable) -> tuple[float, float]:
    """Median seconds per call of (ours, plain): one warm-up call each, then samples of both
    in turn, the order flipped every round, so that both see the same load (unless the
    warm-ups already show a clear winner)."""
    warm = _sample(ours, 1), _sample(plain, 1)
    if max(warm) >= CLEAR_WIN_S and max(warm) >= CLEAR_WIN_RATIO * min(warm):
        return warm
    first = min(warm)
    calls = max(1, math.ceil(MIN_SAMPLE_S / max(first, 1e-9)))
    rounds = int(TIMING_BUDGET_S / max(2 * calls * first, 1e-9))
    rounds = min(MAX_REPEATS, max(MIN_REPEATS, rounds))
    times = ([], [])

    def take(first_round, last_round):
        for r in range(first_round, last_round):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                times[i].append(_sample((ours, plain)[i], calls))
    take(0, rounds)
    if _ratio(statistics.median(times[0]), statistics.median(times[1])) < CLOSE_RATIO:
        take(rounds, max(rounds, MAX_REPEATS))
    return statistics.median(times[0]), statistics.median(times[1])


def _ratio(a: float, b: float) -> float:
    """The slower of two times over the faster (>= 1)."""
    return max(a, b) / max(min(a, b), 1e-12)


def _measure(decision: Decision) -> dict:
    """A timing of both paths of `decision` on this process: its cache record. It leaves
    torch's random state as it was (a run that times and one that reads the cache draw the
    same numbers after it) and runs with autograd on, whatever the caller's context (a first
    use inside evaluation's no_grad, or autocast)."""
    measure = MEASURES[decision.op][0]
    with (torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad(),
          torch.autocast("cpu", enabled=False)):
        torch.manual_seed(0)
        ours, plain = measure(dict(decision.dims), getattr(torch, decision.dtype))
        t_ours, t_plain = time_pair(ours, plain)
    record = {"choice": "ours" if t_ours <= t_plain else "plain",
              "ours_ms": round(t_ours * 1e3, 4), "plain_ms": round(t_plain * 1e3, 4),
              "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if _ratio(t_ours, t_plain) < TIE_RATIO:
        record.update(choice=_rule_record(decision, "rule")["choice"], tie=True)
    return record


def _read_cache() -> dict:
    """The cache file's records (empty when missing, unreadable or of another version)."""
    if _STATE.disk is None:
        try:
            data = json.loads(cache_path().read_text())
            ok = isinstance(data, dict) and data.get("version") == CACHE_VERSION
            _STATE.disk = dict(data.get("choices", {})) if ok else {}
        except (OSError, ValueError):
            _STATE.disk = {}
    return _STATE.disk


def _write_cache(records: dict) -> None:
    """Merge `records` into the cache file (re-read first: another process may have added
    some), published whole; a cache that cannot be written is said once and skipped."""
    if _STATE.cache_failed is not None or not records:
        return
    path = cache_path()
    _STATE.disk = None
    merged = {**_read_cache(), **records}
    try:
        files.write_text_durably(str(path), json.dumps(
            {"version": CACHE_VERSION, "choices": merged}, indent=1, sort_keys=True) + "\n")
        _STATE.disk = merged
    except OSError as err:
        _STATE.cache_failed = f"{type(err).__name__}: {err.strerror or err}"
        _STATE.disk = merged
        _say(f" kernel choice: cache {path} is not writable ({_STATE.cache_failed}); "
             f"measuring in memory for this process")


def _answer(decision: Decision) -> tuple[dict, bool]:
    """(record, measured now) of `decision` on this process: the cache's, else a timing."""
    key = decision.key()
    record = _read_cache().get(key)
    if isinstance(record, dict) and record.get("choice") in ("ours", "plain"):
        return dict(record, source="cache"), False
    return dict(_measure(decision), source="measured"), True


def _say(line: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def _distributed(group=None) -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group) > 1)


def _rule_record(decision: Decision, why: str) -> dict:
    ours = bool(MEASURES[decision.op][1](dict(decision.dims), getattr(torch, decision.dtype)))
    return {"choice": "ours" if ours else "plain", "source": why}


def forced() -> bool | None:
    """The mode's answer where it decides alone (ours: True, plain: False; said once), else
    None: auto and rule, which look at the decision."""
    current = mode()
    if current not in ("ours", "plain"):
        return None
    _announce_mode(current)
    return current == "ours"


def prefer_ours(decision: Decision) -> bool:
    """Whether `decision` takes our kernel (the caller has checked that it applies): by the
    mode, the answer agreed or cached for it, or (auto, one process) a timing now."""
    if (answer := forced()) is not None:
        return answer
    current = mode()
    if current == "rule":  # not kept: a rule may read state that changes (tests patch the ISA)
        return _rule_record(decision, "rule")["choice"] == "ours"
    slot = (decision, torch.get_num_threads())
    record = _STATE.table.get(slot)
    if record is None:
        if _distributed() or torch.compiler.is_compiling():
            record = _rule_record(decision, "rule: not agreed across ranks at model build")
        else:
            record, fresh = _answer(decision)
            if fresh:
                _write_cache({decision.key(): _stored(record)})
        _STATE.table[slot] = record
        _announce(decision, record)
    return record["choice"] == "ours"


def agree(decisions: Iterable[Decision], group=None) -> dict:
    """Answer `decisions` the same way on every rank of `group` (None: the world); every rank
    calls it at the same point (a collective). The union of every rank's decisions is
    answered by the group's first rank (its cache, else a timing) and broadcast. Returns
    {decision: record}. Without torch.distributed (or alone) it answers locally; outside
    auto it does nothing (the mode answers, the same on every rank)."""
    if mode() != "auto":
        _announce_mode(mode())
        return {}
    mine = list(dict.fromkeys(decisions))
    if not _distributed(group):
        answers = _answer_all(mine)
    else:
        dist = torch.distributed
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        union = list(dict.fromkeys(d for per_rank in gathered for d in per_rank))
        src = dist.get_global_rank(group, 0) if group is not None else 0
        box = [_answer_all(union) if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src, group=group)
        answers = box[0]
    threads = torch.get_num_threads()
    for decision, record in answers.items():
        _STATE.table[(decision, threads)] = record
        _announce(decision, record)
    return answers


def _answer_all(decisions: list) -> dict:
    """Each decision answered in turn; each answer is kept at once, so that a timing of a
    later decision that asks an earlier one (attention asks "attention_products") takes it."""
    answers, fresh = {}, {}
    threads = torch.get_num_threads()
    for decision in decisions:
        answers[decision], measured = _answer(decision)
        _STATE.table[(decision, threads)] = answers[decision]
        if measured:
            fresh[decision.key()] = _stored(answers[decision])
    _write_cache(fresh)
    return answers


def _stored(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "source"}


def _announce(decision: Decision, record: dict) -> None:
    """One line per decision and process, on rank 0: the path and why."""
    if decision in _STATE.announced:
        return
    _STATE.announced.add(decision)
    plain = MEASURES[decision.op][2](dict(decision.dims))
    ours = MEASURES[decision.op][3](dict(decision.dims))
    path = ours if record["choice"] == "ours" else plain
    shape = " ".join(f"{name}{value}" for name, value in decision.dims)
    why = record["source"]
    if "ours_ms" in record:
        where = ("in memory" if _STATE.cache_failed else f"cached in {cache_path()}")
        verb = ("measured now" if why == "measured" else
                f"from the cache, measured {record.get('measured', '?')}")
        tie = (f", within {round(100 * (TIE_RATIO - 1))}%: a tie, the rule's path"
               if record.get("tie") else "")
        why = (f"auto, {verb}: {'ours' if ours == 'our kernel' else ours} "
               f"{record['ours_ms']:.3f} ms, {plain} {record['plain_ms']:.3f} ms{tie}; {where}")
    _say(f" kernel choice: {decision.op} {decision.dtype} {shape}: {path} ({why})")


def _announce_mode(current: str) -> None:
    if current in _STATE.announced:
        return
    _STATE.announced.add(current)
    paths = {"ours": "our kernels wherever they apply", "plain": "the PyTorch paths",
             "rule": "each op's fixed rule, no timing"}[current]
    source = (f"--fused-kernels-choice {current}" if _STATE.mode else f"{MODE_ENV}={current}")
    _say(f" kernel choice: {paths} ({source})")
