"""Two ranks of one job take the same fused paths although their own timings disagree: rank
0's answers are broadcast at model build (megatron/fused/choice.py `agree`), a rerun reads
rank 0's cache, and a decision not agreed takes the rule on every rank, untimed."""
import os

from tests.distributed.run_ranks import run_ranks


def _agree_on_two_ranks(rank, world_size, cache_dir):
    import torch
    from megatron.arguments import parse_args
    from megatron.fused import choice
    from megatron.training.kernel_choices import agree_kernel_choices, planned_decisions
    os.environ[choice.MODE_ENV] = "auto"
    os.environ[choice.CACHE_ENV] = os.path.join(cache_dir, f"rank{rank}", "kernel-choice.json")
    calls = []

    def timer(ours, plain):  # each rank "measures" the other path faster
        calls.append(1)
        return (1.0, 2.0) if rank == 0 else (2.0, 1.0)
    choice.time_pair = timer
    config, _ = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                            "4", "--seq-length", "64", "--max-position-embeddings", "64",
                            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                            "--tensor-model-parallel-size", "2"], world_size=2)
    config.model.padded_vocab_size = 256
    planned = planned_decisions(config)
    local = {d: choice._measure(d)["choice"] for d in planned}  # what each alone would take
    calls.clear()
    extra = choice.Decision("layer_norm", "float32", (("rows", 2 ** (10 + rank)), ("hidden", 64)))
    agree_kernel_choices(config, "cpu")
    choice.agree([extra])  # each rank asks its own: the union is answered by rank 0
    agreed = {d: choice.prefer_ours(d) for d in planned}
    other = choice.Decision("layer_norm", "float32", (("rows", 2 ** (11 - rank)), ("hidden", 64)))
    result = {"local": local, "agreed": agreed, "calls": len(calls),
              "extra": choice.prefer_ours(extra), "other": choice.prefer_ours(other),
              "cache": os.path.exists(os.environ[choice.CACHE_ENV])}
    unforeseen = choice.Decision("rms_norm", "float32", (("rows", 4096), ("hidden", 96)))
    calls.clear()
    result["unforeseen"] = (choice.prefer_ours(unforeseen), len(calls))
    choice.reset()  # a rerun on this machine: rank 0's cache answers, nothing is timed
    choice.agree(planned)
    result["rerun"] = ({d: choice.prefer_ours(d) for d in planned}, len(calls))
    torch.distributed.barrier()
    return result


def test_two_ranks_agree_on_rank_zeros_measured_choice(tmp_path):
    r0, r1 = run_ranks(_agree_on_two_ranks, 2, str(tmp_path))
    assert r0["local"] != r1["local"]  # alone, the two ranks would take different paths
    assert set(r0["local"].values()) == {"ours"} and set(r1["local"].values()) == {"plain"}
    ops = {d.op for d in r0["agreed"]}
    assert {"attention", "layer_norm", "exp_sum"} <= ops, ops
    assert r0["agreed"] == r1["agreed"] and all(r0["agreed"].values())  # rank 0's: ours
    assert r0["calls"] > 0 and r1["calls"] == 0  # only rank 0 timed
    assert r0["extra"] and r1["extra"] and r0["other"] and r1["other"]  # the union, rank 0's
    assert r0["cache"] and not r1["cache"]
    assert r0["unforeseen"] == r1["unforeseen"] == (True, 0)  # RMSNorm's rule, untimed
    assert r0["rerun"] == r1["rerun"] == (r0["agreed"], 0)
