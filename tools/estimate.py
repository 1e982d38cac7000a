"""Plan a run before launching it: per-rank memory and a predicted step time.

    python tools/estimate.py --world-size 64 [--device-flops 400e12 --link-bandwidth 100e9] \\
        [--device cuda] [--pp-rank R] -- <pretrain_gpt.py flags>

Reads the very flags `pretrain_gpt.py` takes (parsed and checked by the same
code, for the given world size, default $WORLD_SIZE or 1), builds the tokenizer
they name for the padded vocabulary (or takes --vocab-size with
--tokenizer-type NullTokenizer), and prints for one rank of each pipeline
stage (or of --pp-rank): parameters, gradients, optimizer state, activations
(per micro batch and the micro batches in flight), under --use-torch-fsdp2 the
shards of the first three and what FSDP gathers and accumulates unsharded, and the
total, in GiB, and its
transformer layers (as the pipeline layout places them); with
--device-flops (FLOP/s of one device) the step time from the hardware FLOPs,
the pipeline bubble and, with --link-bandwidth (bytes/s), the communication.
--explain-memory adds what one transformer layer saves for backward, tensor by tensor.
See megatron/training/memory.py for what is counted.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_gpt  # noqa: E402
from megatron.arguments import fail  # noqa: E402
from megatron.training.memory import (GiB, Layout, estimate, layer_activations,  # noqa: E402
                                      local_seq_length, memory_rows, stage_layers)

LABELS = {"fsdp gathered parameters": "gathered", "fsdp unsharded gradients": "full-grads"}
"""Column names of the FSDP rows (megatron/training/memory.py's fsdp_working_bytes)."""
FSDP_NOTE = ("under --use-torch-fsdp2 parameters, gradients and optimizer are this rank's shards; "
             "gathered: the all-gathered units held at the peak (the root, the unit in backward "
             "and the prefetched one; all with --no-fsdp-reshard-after-forward); full-grads: the "
             "unsharded gradients then (that unit's and its fp32 reduce-scatter copy, the root's; "
             "with several micro batches the whole chunk's fp32 accumulation)")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                   help="processes of the run (default $WORLD_SIZE or 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="device type of the run (it decides the attention path)")
    p.add_argument("--device-flops", type=float, default=None,
                   help="sustained FLOP/s of one device, e.g. 400e12")
    p.add_argument("--link-bandwidth", type=float, default=None,
                   help="bytes/s between two devices, e.g. 100e9")
    p.add_argument("--pp-rank", type=int, default=None, help="one pipeline stage (default: all)")
    p.add_argument("--explain-memory", action="store_true",
                   help="list what one transformer layer saves for backward, tensor by tensor")
    ours, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if ours.world_size < 1:
        fail(f"--world-size must be positive, got {ours.world_size}")
    return ours, rest


def report(config, ours) -> str:
    pp = config.parallel.pipeline_model_parallel_size
    ranks = range(pp) if ours.pp_rank is None else [ours.pp_rank]
    rows = (*memory_rows(config), "total")
    lines = [f"{'stage':>6} " + " ".join(f"{LABELS.get(row, row):>12}" for row in rows)
             + f" {'in flight':>10} {'layers':>7}"]
    timing = {}
    for rank in ranks:
        if not 0 <= rank < pp:
            fail(f"--pp-rank {rank} outside the {pp} pipeline stages")
        out = estimate(config, Layout(ours.world_size, rank, ours.device), ours.device_flops,
                       ours.link_bandwidth)
        lines.append(f"{rank:>6} " + " ".join(f"{out[row] / GiB:>9.3f}GiB" for row in rows)
                     + f" {out['in_flight_micro_batches']:>10.2f} {stage_layers(config, rank):>7}")
        if "step_seconds" in out:
            timing = out  # compute is every stage's; communication the last stage's
    first = estimate(config, Layout(ours.world_size, 0, ours.device))
    lines.append(f"activations per micro batch (stage 0): {first['activations_per_micro_batch'] / GiB:.3f} GiB")
    if config.parallel.use_torch_fsdp2:
        lines.append(FSDP_NOTE)
    if timing:
        lines.append(f"step time: {timing['step_seconds']:.3f} s (compute {timing['compute_seconds']:.3f} s "
                     f"incl. pipeline bubble, communication {timing['communication_seconds']:.3f} s; "
                     f"{timing['hardware_flops'] / 1e12:.1f} TFLOP per step)")
    if ours.explain_memory:
        lines += explain_layer(config, ours.device)
    return "\n".join(lines)


def explain_layer(config, device: str):
    """One transformer layer's saved activations over one micro batch, largest first,
    against Megatron's 34 s b h / t bytes (its formula for a 16-bit layer with sequence
    parallelism and selective recomputation)."""
    m, p = config.model, config.parallel
    b = config.training.micro_batch_size
    parts = layer_activations(config, b, device)
    total = sum(parts.values())
    megatron = 34 * local_seq_length(config) * b * m.hidden_size / p.tensor_model_parallel_size
    lines = [f"one transformer layer saves for backward (micro batch {b}, per rank):"]
    for name, size in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<34} {size / 2 ** 20:>10.2f} MiB {100 * size / total:>5.1f}%")
    lines.append(f"  {'total':<34} {total / 2 ** 20:>10.2f} MiB "
                 f"({total / megatron:.2f}x Megatron's 34 s b h / t = {megatron / 2 ** 20:.2f} MiB)")
    return lines


def main(argv=None):
    ours, flags = parse(argv)
    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(ours.world_size)  # what pretrain_gpt's layout checks read
    try:
        config, _ = pretrain_gpt.setup(flags)
    finally:
        if previous is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = previous
    print(report(config, ours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
