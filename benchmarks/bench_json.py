"""What a benchmark writes with `--json PATH`, beside its unchanged text output: its results and
the machine they were measured on (CPU, the ISA of our kernels and of torch's, threads, load),
for benchmarks/report.py. The file is written under a temporary name, then renamed."""
import json
import os
from pathlib import Path


def machine() -> dict:
    """Where this process runs: CPU model, our kernels' ISA (and whether MEGATRON_CPU_ISA forced
    it), torch's kernels' ISA, torch's thread count and the 1-minute load average."""
    import torch

    from megatron.fused import kernels
    return {"cpu": kernels.cpu_model(), "isa": kernels.cpu_isa(),
            "isa_forced": kernels.requested_isa() != "default",
            "torch_isa": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0]}


def write(path, benchmark: str, **results) -> None:
    """{"benchmark", "machine", **results} as JSON at `path`; nothing when `path` is None."""
    if not path:
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"benchmark": benchmark, "machine": machine(), **results},
                              indent=1))
    tmp.replace(path)
