"""Nothing outlives an error: DataLoader workers and any other child process end with the run.

Loader workers ignore SIGTERM (it is the trainer's, see samplers.py), so the
interpreter's own exit hook, which terminates daemonic children and then joins them,
would wait for them forever. `stop_children` runs first (an exit hook registered
after multiprocessing's, and called before `os._exit`): it shuts the open loaders
down the way their iterators do, then terminates, joins with a deadline and kills
whatever is left.
"""
import atexit
import multiprocessing
import time

from megatron.data.samplers import close_loaders

GRACE_SECONDS = 3.0


def stop_children(grace: float = GRACE_SECONDS) -> int:
    """End this process's children within about `grace` seconds; returns how many were left
    after the loaders' own shutdown."""
    close_loaders()
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(1.0)
    return len(children)


atexit.register(stop_children)
