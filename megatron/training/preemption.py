"""Stopping cleanly when asked: SIGTERM (--exit-signal-handler, what SLURM sends
before a kill), a time limit (--exit-duration-in-mins) or a file
(--kill-switch-path). The run then finishes the current iteration, saves and
exits 0. Each rank only notes the request; `RunGuard` makes all ranks agree, so
they stop at the same iteration."""
import os
import signal
import time
from typing import Optional


class StopRequests:
    def __init__(self, training_config):
        self.cfg = training_config
        self.start = time.monotonic()
        self.signalled = False
        self._previous = None

    def listen(self) -> None:
        """Catch SIGTERM from now on (with --exit-signal-handler); `close` undoes it."""
        if self.cfg.exit_signal_handler and self._previous is None:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def reason(self) -> Optional[str]:
        """Why this rank wants to stop, or None."""
        if self.signalled:
            return "SIGTERM received (--exit-signal-handler)"
        minutes = self.cfg.exit_duration_in_mins
        if minutes is not None and time.monotonic() - self.start >= 60.0 * minutes:
            return f"--exit-duration-in-mins {minutes:g} reached"
        path = self.cfg.kill_switch_path
        if path and os.path.exists(path):
            return f"--kill-switch-path {path} exists"
        return None

    def close(self) -> None:
        """Give SIGTERM back its previous handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
