"""The random-number state a checkpoint carries, so that a resumed run draws what the
uninterrupted one would have: Python's, numpy's, torch's, the device generator's and the
model-parallel tracker's (megatron/mpu/random.py). Numpy's key array is stored as a torch
tensor, which `torch.load(weights_only=True)` reads."""
import random

import numpy as np
import torch

from megatron.mpu.random import get_device_rng_state, get_rng_tracker, set_device_rng_state


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"random_rng_state": random.getstate(),
            "np_rng_state": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
            "torch_rng_state": torch.get_rng_state(),
            "device_rng_state": get_device_rng_state(),
            "rng_tracker_states": get_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    set_device_rng_state(state["device_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])


def current_device_states():
    """(device generator state, tracker states) of this process, which a foreign RNG entry
    falls back to where it cannot seed this device (megatron_legacy.rng_entry_to_ours)."""
    return get_device_rng_state(), get_rng_tracker().get_states()
