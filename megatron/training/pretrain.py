"""`pretrain()`: build, resume, train, evaluate, save: the flow every entry point shares."""
import contextlib
import math
import os
import time
from typing import Callable, Optional

from megatron.checkpointing import api, collectives
from megatron.checkpointing.formats import RunState
from megatron.checkpointing.io import check_writable
from megatron.checkpointing.lock import SaveLock
from megatron.checkpointing.rng import rng_state, set_rng_state
from megatron.config import ConfigError
from megatron.training.elastic_events import restart_line, resumed_line
from megatron.training.flops import ThroughputMeter
from megatron.training.logging import format_log_line, format_validation
from megatron.training.run_guard import RunGuard
from megatron.training.model_stats import log_line_extras
from megatron.training.parallelize import build_model, params_dtype
from megatron.training.trainer import (ReplayIterators, Trainer, TrainState, print_rank_0,
                                       print_rank_last, total_iterations)


def check_run_paths(config) -> None:
    """Check the paths a run writes or watches, before torch.distributed starts: every rank
    checks the same paths (so only rank 0 reports a problem, see megatron.arguments.fail)."""
    switch = config.training.kill_switch_path
    if switch and not os.path.isdir(os.path.dirname(os.path.abspath(switch))):
        raise ConfigError(f"--kill-switch-path {switch}: its directory "
                          f"{os.path.dirname(os.path.abspath(switch))} does not exist, so the "
                          f"file could never be created; create the directory or fix the path")
    if config.checkpoint.save:
        check_writable(config.checkpoint.save)


@contextlib.contextmanager
def held_save_lock(config):
    """Rank 0 holds the --save lock (lock.py) while the block runs. Collective (call once
    torch.distributed has started): a refusal is agreed by every rank, so every rank exits 2
    and rank 0 alone prints the line naming the holder."""
    lock = None
    if config.checkpoint.save and os.environ.get("RANK", "0") == "0":
        lock = SaveLock(config.checkpoint.save)
    try:
        with collectives.agreed(f"locking --save {config.checkpoint.save}"):
            notice = lock.acquire() if lock is not None else None
        if notice:
            print(notice, flush=True)
        yield
    finally:
        if lock is not None:
            lock.release()


def pretrain(config, pstate, device, model_provider: Callable, data_provider: Callable,
             forward_step: Callable) -> TrainState:
    """Train the model `model_provider` builds on the data `data_provider` serves.

    model_provider(cfg, pre_process, post_process, layer_offset, num_layers) -> module
    (megatron/training/parallelize.py builds and parallelises the chunks)
    data_provider(consumed_train, consumed_valid) -> (train_iter, valid_iter, test_iter)
    forward_step(data_iterator, model) -> (output, loss_func)
    """
    if not config.checkpoint.save and config.training.exit_interval:
        print_rank_0(f" WARNING: --exit-interval {config.training.exit_interval} without --save: "
                     f"the run stops there and nothing is saved")
    guard = RunGuard(config, pstate, device)
    restarted = restart_line(pstate.dims.world_size)
    if restarted:
        print_rank_0(restarted)
    models = build_model(config, pstate, device, model_provider)
    trainer = Trainer(config, pstate, device, models, guard.hangs.counting(forward_step))
    guard.attach(trainer)
    state = trainer.state
    if config.checkpoint.load:
        _load(trainer, config, pstate)
    # Building data loaders draws from the default generator; keep it out of the
    # training RNG stream so a resumed run continues exactly where it stopped.
    rng = rng_state()
    train_iter, valid_iter, test_iter = data_provider(state.consumed_train, state.consumed_valid)
    set_rng_state(rng)
    chunks = len(models)
    train_iters = ReplayIterators(train_iter, chunks).all() if train_iter is not None else None
    valid_iters = _replayed(valid_iter, chunks)
    meter = _throughput_meter(config, pstate, device)
    guard.stops.listen()
    try:
        if _train_loop(trainer, train_iters, valid_iters, guard, meter):
            trainer.tensorboard.close()
            return state
    finally:
        _wait_for_saves(trainer)  # a save in flight (--async-save) is durable before we go on
        guard.close()
    if valid_iters is not None and config.training.eval_iters > 0:
        _evaluate_and_print(trainer, valid_iters, f"iteration {state.iteration}", verbose=True)
    if test_iter is not None and config.training.eval_iters > 0:
        _evaluate_and_print(trainer, _replayed(test_iter, chunks),
                            "the end of training for test data", verbose=True)
    trainer.tensorboard.close()
    return state


def _run_state(trainer: Trainer) -> RunState:
    return RunState(trainer.models, trainer.config, trainer.pstate, trainer.optimizer,
                    trainer.scheduler, trainer.state.consumed_train, trainer.state.consumed_valid)


def _load(trainer: Trainer, config, pstate) -> None:
    """Resume (or start fine-tuning) from --load, with Megatron's two log lines."""
    root, state = config.checkpoint.load, trainer.state
    found = api.detect(root)
    if found is None:
        print_rank_0(f" no checkpoint found at {root}; starting from scratch")
        return
    for line in api.loading_lines(found):
        print_rank_0(line)
    state.iteration, state.consumed_train, state.consumed_valid = api.load(
        root, _run_state(trainer))
    print_rank_0(f"  successfully loaded checkpoint from {root} at iteration {state.iteration}")
    weights_only = config.checkpoint.finetune and not found.release
    print_rank_0(resumed_line(state.iteration, pstate.dims,
                              weights_of=found.iteration if weights_only else None))


def _save(trainer: Trainer, guard: RunGuard) -> None:
    """Save, a peer that stops responding in the save's collectives being one line too."""
    with guard.hangs.watch(trainer.state.iteration,
                           f"the checkpoint save of iteration {trainer.state.iteration}"):
        _save_now(trainer)


def _save_now(trainer: Trainer) -> None:
    cfg, state = trainer.config, trainer.state
    if cfg.checkpoint.async_save:
        from megatron.checkpointing.async_save import AsyncSaver
        saver = trainer.__dict__.setdefault("async_saver", AsyncSaver())
        saver.save(cfg.checkpoint.save, state.iteration, _run_state(trainer))
        print_rank_0(f" saving checkpoint at iteration {state.iteration:7d} to "
                     f"{cfg.checkpoint.save} in the background (--async-save)")
        return
    api.save(cfg.checkpoint.save, state.iteration, _run_state(trainer))
    print_rank_0(f" saved checkpoint at iteration {state.iteration:7d} to {cfg.checkpoint.save}")


def _wait_for_saves(trainer: Trainer) -> None:
    saver = trainer.__dict__.get("async_saver")
    if saver is not None and saver.pending:
        print_rank_0(" waiting for the checkpoint being written (--async-save)")
    if saver is not None:
        saver.wait()


def _throughput_meter(config, pstate, device) -> Optional[ThroughputMeter]:
    if not config.logging.log_throughput:
        return None
    meter = ThroughputMeter(config.model, device, params_dtype(config), pstate.dims.world_size,
                            config.logging.peak_flops)
    print_rank_0(meter.describe())
    return meter


def _train_loop(trainer: Trainer, train_iters, valid_iters, guard: RunGuard, meter=None) -> bool:
    """Train to the last iteration; True when stopped early on request (after saving)."""
    cfg, state = trainer.config, trainer.state
    total = total_iterations(cfg)
    log = _LogWindow()
    print_rank_0(f" training from iteration {state.iteration} to {total}")
    while state.iteration < total:
        trainer.microbatches.update(state.consumed_train)
        if cfg.training.skipped_iteration(state.iteration + 1):
            _skip_iteration(trainer, train_iters)
            if _interval_save_due(cfg, state.iteration):  # else a skipped last iteration is never saved
                _save(trainer, guard)
            continue
        start = time.perf_counter()
        with guard.hangs.watch(state.iteration + 1):
            losses, grad_norm, skipped, nan = trainer.train_step(train_iters)
        state.iteration += 1
        state.consumed_train += trainer.microbatches.global_batch_size
        if losses:
            norm = {} if grad_norm is None else {"grad norm": grad_norm}
            state.history.append(dict(losses, iteration=state.iteration, **norm))
        log.add(losses, time.perf_counter() - start, skipped, nan)
        if state.iteration % cfg.logging.log_interval == 0:
            _log(trainer, log, grad_norm, total, meter)
        if guard.should_stop(state.iteration, losses, grad_norm, nan):
            if cfg.checkpoint.save:
                _save(trainer, guard)
            print_rank_0(f" exiting program at iteration {state.iteration}: {guard.reason}")
            return True
        saved = _interval_save_due(cfg, state.iteration)
        if saved:
            _save(trainer, guard)
        if valid_iters is not None and cfg.training.eval_iters > 0 \
                and state.iteration % cfg.training.eval_interval == 0 and state.iteration < total:
            _evaluate_and_print(trainer, valid_iters, f"iteration {state.iteration}")
        if cfg.training.exit_interval and state.iteration % cfg.training.exit_interval == 0:
            if cfg.checkpoint.save and not saved:
                _save(trainer, guard)
            print_rank_0(f" exiting program at iteration {state.iteration}")
            return False
    if cfg.checkpoint.save and state.iteration > 0 and not _interval_save_due(cfg, state.iteration):
        _save(trainer, guard)
    return False


def _interval_save_due(cfg, iteration: int) -> bool:
    """--save-interval falls on this iteration (and there is a --save)."""
    ckpt = cfg.checkpoint
    return bool(ckpt.save and ckpt.save_interval and iteration % ckpt.save_interval == 0)


def _skip_iteration(trainer: Trainer, train_iters) -> None:
    """--skip-train-iteration-range: consume and drop this iteration's batches, untrained;
    the iteration, consumed samples and lr schedule move on as if it had been trained."""
    state = trainer.state
    for _ in range(trainer.microbatches.num_micro_batches):
        for chunk_iter in train_iters:
            next(chunk_iter)
    state.iteration += 1
    state.consumed_train += trainer.microbatches.global_batch_size
    trainer.scheduler.step(trainer.microbatches.global_batch_size)
    print_rank_0(f" skipped iteration {state.iteration} (--skip-train-iteration-range)")


class _LogWindow:
    """Sums over one log interval."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.losses, self.count, self.seconds, self.skipped, self.nans = {}, 0, 0.0, 0, 0

    def add(self, losses, seconds, skipped, nan):
        if not (skipped or nan):  # the averages are over applied steps only, as in Megatron
            for key, value in losses.items():
                self.losses[key] = self.losses.get(key, 0.0) + value
        self.count += 1
        self.seconds += seconds
        self.skipped += int(skipped)
        self.nans += int(nan)


def _log(trainer: Trainer, log: _LogWindow, grad_norm: Optional[float], total: int,
         meter: Optional[ThroughputMeter] = None) -> None:
    cfg, state = trainer.config, trainer.state
    lr = trainer.scheduler.get_lr()
    scale = trainer.optimizer.loss_scale
    scale = 1.0 if scale is None else float(scale.item())
    normal = max(1, log.count - log.skipped - log.nans)
    losses = {key: value / normal for key, value in log.losses.items()}
    gbs = trainer.microbatches.global_batch_size
    seconds = log.seconds / max(1, log.count)
    text, scalars = meter.log_fields(gbs, seconds) if meter is not None else ("", {})
    print_rank_last(format_log_line(state.iteration, total, state.consumed_train, 1000.0 * seconds,
                                    lr, gbs, losses, scale, grad_norm, log.skipped, log.nans, text,
                                    log_line_extras(cfg, trainer.models, trainer.pstate)))
    timings = trainer.timers.pop_all()
    if trainer.stragglers is not None:
        print_rank_0(trainer.stragglers.report(state.iteration, timings,
                                               trainer.timers.pop_waits(), log.count))
    if timings and cfg.logging.timing_log_level > 0:
        print_rank_last(" time (ms) | " + " | ".join(
            f"{name}: {1000.0 * sec / max(1, log.count):.2f}" for name, sec in sorted(timings.items())))
    scalars.update({f"{key}": value for key, value in losses.items()})
    scalars.update({"learning-rate": lr, "loss-scale": scale})
    if grad_norm is not None:
        scalars["grad-norm"] = grad_norm
    if cfg.logging.log_batch_size_to_tensorboard:
        scalars["batch-size"] = gbs
    if cfg.logging.log_timers_to_tensorboard:
        scalars.update({f"{name}-time": sec / max(1, log.count) for name, sec in timings.items()})
    trainer.tensorboard.scalars(scalars, state.iteration)
    log.reset()


def _replayed(iterator, chunks: int):
    """Per-chunk iterators of a split ({group name: them} for several named groups)."""
    if isinstance(iterator, dict):
        return {name: _replayed(it, chunks) for name, it in iterator.items()}
    return None if iterator is None else ReplayIterators(iterator, chunks).all()


def _evaluate_and_print(trainer: Trainer, iterators, prefix: str, verbose: bool = False) -> None:
    """Evaluate and print Megatron's validation line; named groups each get theirs
    (" validation loss at iteration N | NAME | lm loss value: ..."), and all advance the
    validation samples as one group does, so that each resumes where it stopped."""
    if not isinstance(iterators, dict):
        return _evaluate_one(trainer, iterators, prefix, verbose)
    state = trainer.state
    start = state.consumed_valid
    for name, its in iterators.items():
        state.consumed_valid = start
        if its is not None:
            _evaluate_one(trainer, its, f"{prefix} | {name}", verbose, name)


def _evaluate_one(trainer: Trainer, iterators, prefix: str, verbose: bool, group=None) -> None:
    cfg, state = trainer.config, trainer.state
    losses = trainer.evaluate(iterators, cfg.training.eval_iters, verbose)
    if not losses:
        return
    state.validation.append(dict(losses, iteration=state.iteration, **(
        {"group": group} if group else {})))
    line = format_validation(prefix, losses)
    print_rank_last("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    where = f" {group}" if group else ""
    scalars = {f"{key} validation{where}": value for key, value in losses.items()}
    if cfg.logging.log_validation_ppl_to_tensorboard:
        scalars.update({f"{key} validation ppl": math.exp(min(20.0, v)) for key, v in losses.items()})
    trainer.tensorboard.scalars(scalars, state.iteration)
