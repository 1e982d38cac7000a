"""Run Megatron-Core (megatron-core 0.16.1) as a reference on CPU, beside our `megatron`.

Both projects are the package `megatron`, and ours wins wherever the repository is on
sys.path. So a reference runs in a subprocess whose path holds site-packages and not
the repository: `run(script, inputs, world_size)` saves `inputs` (torch.save), starts
`script` (a file in tests/, run with PYTHONPATH cleared and the working directory a
temporary folder; with world_size > 1 under torch.distributed.run) and returns what
each rank saved with `save_outputs`. Inside the script, `init(world_size)` starts gloo
and applies the CPU monkeypatches that ../shared/references.md lists.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
from typing import List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def available() -> bool:
    """megatron-core is installed (in site-packages, not shadowed there by our package)."""
    for entry in sys.path:
        if entry and os.path.isdir(os.path.join(entry, "megatron", "core")) \
                and os.path.abspath(entry) != ROOT:
            return importlib.util.find_spec("torch") is not None
    return False


def run(script: str, inputs: dict, world_size: int = 1, timeout: int = 600) -> List[dict]:
    """Per-rank outputs of tests/`script` given `inputs`."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(inputs, os.path.join(tmp, "inputs.pt"))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(MCORE_REFERENCE_DIR=tmp, OMP_NUM_THREADS="1")
        path = os.path.join(HERE, script)
        cmd = [sys.executable, path]
        if world_size > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={world_size}", path]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return [torch.load(os.path.join(tmp, f"outputs_{r}.pt"), weights_only=True) for r in range(world_size)]


# -- inside the reference process ------------------------------------------------------------
def load_inputs() -> dict:
    return torch.load(os.path.join(os.environ["MCORE_REFERENCE_DIR"], "inputs.pt"),
                      weights_only=True)


def save_outputs(outputs: dict) -> None:
    rank = int(os.environ.get("RANK", "0"))
    torch.save(outputs, os.path.join(os.environ["MCORE_REFERENCE_DIR"], f"outputs_{rank}.pt"))


def init(world_size: int = 1, **parallel) -> None:
    """gloo process group, Megatron-Core's parallel state (`parallel`: its
    initialize_model_parallel arguments) and the CPU patches."""
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    dist.init_process_group("gloo")
    patch_for_cpu()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(**parallel)


def patch_for_cpu() -> None:
    """The monkeypatches of ../shared/references.md that an MoE layer needs on CPU."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None
    from megatron.core.tensor_parallel import random as tp_random
    tracker = tp_random.get_cuda_rng_tracker()
    tracker.add = lambda *a, **k: None
