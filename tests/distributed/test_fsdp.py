"""--use-torch-fsdp2 trains like one process, and its torch_dist checkpoints resume both ways.

The model of the acceptance is the LLaMA-style one (GQA, RoPE, RMSNorm, SwiGLU, untied: the
embedding its own unit), fp32, with clipping active (--clip-grad 0.5, below every gradient
norm here), --log-params-norm and --log-num-zeros-in-grad. Each layout of LAYOUTS2 (a spawn of
2 ranks) and LAYOUTS4 (a spawn of 4) matches its single-process reference over ITERS
iterations: losses and gradient norms on every reporting rank and the params norms within
1e-5 relative (the layout tests' tolerance), zero counts within ZEROS_SLACK entries that round
to 0 in one order and not the other; saved at SAVE_AT it resumes to the uninterrupted losses
bit for bit, and those of IN_ONE also in one process without FSDP within 1e-5. The LLaMA-style
model runs at DP 2, DP 4, TP 2 x DP 2 with sequence parallelism (GQA's k / v and the SP
norms' partial gradients under FSDP's shards; thousands of zero gradient entries: the untied
embedding rows of absent tokens), CP 2 x DP 2 (the FSDP mesh DP x CP), PP 2 x DP 2 (1F1B) and
CP 2 x PP 2; its MoE variant at EP 2 x DP 2 (expert-DP 1), EP 2 x DP 4 (experts sharded over
expert-DP 2, dense weights over DP 4) and EP 2 x PP 2. The tied GPT (the root unit holds the
embedding) runs full and selective recomputation at DP 2 and the interleaved schedule at
PP 2 x DP 2 (tied across the first and last stage; also --no-fsdp-reshard-after-forward).

Checkpoints across layouts: the LLaMA-style one-process checkpoint resumes under FSDP at
DP 2; the DP 2 FSDP checkpoint resumes at TP 2 x PP 2 with the distributed optimizer (in the
spawn of 4), and a TP 2 x PP 2 distributed-optimizer checkpoint under FSDP at DP 2 (a third,
short spawn of 2), each continuing as the uninterrupted run within 1e-5 (losses and gradient
norms). Megatron-LM's --ckpt-format torch_dcp at DP 2 under FSDP resumes under FSDP bit for
bit, in one process without FSDP and at TP 2 x PP 2 with the distributed optimizer within
1e-5. bf16 (MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction and fp32 sharded
main params, made from the bf16 weights as the optimizer without FSDP makes its main params)
with --no-fsdp-reshard-after-forward at DP 2 equals the same bf16 run at DP 2 without FSDP
within 1e-5, losses and gradient norms (bit for bit here: the same fused Adam on the shards,
a gradient norm that shards do not change), and resumes exactly. Against one process (micro
batches of 1) it agrees within BF16_TOL only: there the 8 micro batches' fp32 gradients add
in another order, the one-ulp differences of the main params flip bf16 roundings of the
model, and those grow (2.2e-4 in gradient norm by iteration 10, on either side of FSDP).
Its checkpoints cross to and from one process: FSDP at DP 2 continues a one-process
checkpoint as DP 2 without FSDP does, and one process continues an FSDP checkpoint as it
continues the DP 2 one without FSDP, each within 1e-5. FSDP's collectives are counted: one reduce-scatter per unit and global batch
(4 micro batches per rank), and with kept parameters one all-gather. Unsupported
combinations are one line (tests/unit/test_fsdp_units.py runs them through pretrain_gpt.py).
"""
import contextlib
import io
import os
import re

import pytest
import torch

from tests.distributed.layouts import LOSS_TOL, llama_style
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import assert_exits_2_with_one_line, one_thread, tiny_gpt_argv, wiki_workdir

ITERS = 10
SAVE_AT = 5
ZEROS_SLACK = 3
"""Gradient entries allowed to be exactly 0 in one run and not the other (rounding)."""
FSDP = ["--use-torch-fsdp2"]
CLIP = ["--clip-grad", "0.5", "--log-params-norm", "--log-num-zeros-in-grad",
        "--ckpt-format", "torch_dist"]
LLAMA_BF16 = [*llama_style(32), "--bf16", "--clip-grad", "0.5", "--ckpt-format", "torch_dist"]
BF16_TOL = 2e-3
"""bf16 runs whose gradients add in another order (one process against DP 2): half a bf16
ulp (2^-9 relative)."""
DIST = ["--ckpt-format", "torch_dist"]
LLAMA = [*llama_style(32), "--clip-grad", "0.5", "--log-num-zeros-in-grad",
         "--log-params-norm", *DIST]
"""The LLaMA-style model of the acceptance (GQA, RoPE, RMSNorm, SwiGLU, untied) in fp32, with
clipping active (its gradient norms are 0.63-1.0 here) and the norms and zero counts logged."""
TP2 = ["--tensor-model-parallel-size", "2"]
MOE = [*llama_style(32), "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2",
       "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2", "--clip-grad", "0.5",
       "--log-num-zeros-in-grad", "--log-params-norm", *DIST]
"""A LLaMA-style MoE model: layer 0 of 2 has 4 experts (top-2), layer 1 is dense."""
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2_PP2_DIST_OPT = [*LLAMA, *TP2, *PP2, "--use-distributed-optimizer"]
DCP = ["--ckpt-format", "torch_dcp"]
"""Megatron-LM's torch_dcp in place of torch_dist (the later flag wins)."""
"""The layout a DP 2 FSDP checkpoint resumes at, and saves one FSDP at DP 2 resumes from."""
LAYOUTS2 = {  # name: (flags, micro batch size, the reference's name); FSDP at DP 2
    "dp2": (LLAMA, 1, "llama"),
    "recompute-full": ([*CLIP, "--recompute-granularity", "full", "--recompute-method",
                        "uniform", "--recompute-num-layers", "1"], 1, "one"),
    "recompute-selective": ([*CLIP, "--recompute-granularity", "selective"], 1, "one"),
    # expert-DP of one rank: the experts' unit divides its unsummed gradient by DP once
    "ep2-expert-dp1": ([*MOE, "--expert-model-parallel-size", "2"], 2, "moe"),
}
LAYOUTS4 = {  # the same, in a world of 4
    "dp4": (LLAMA, 1, "llama"),
    "tp2-sp": ([*LLAMA, *TP2, "--sequence-parallel"], 1, "llama"),
    "cp2": ([*LLAMA, "--context-parallel-size", "2"], 1, "llama"),
    "pp2": ([*LLAMA, *PP2], 1, "llama"),
    # 4 layers for 2 stages x 2 virtual chunks: the tied GPT
    "pp2-interleaved": ([*CLIP, *PP2, "--num-layers-per-virtual-pipeline-stage", "1"], 1, "one"),
    "pp2-interleaved-kept": ([*CLIP, *PP2, "--num-layers-per-virtual-pipeline-stage", "1",
                              "--no-fsdp-reshard-after-forward"], 1, "one"),
    "ep2": ([*MOE, "--expert-model-parallel-size", "2"], 2, "moe"),  # DP 4, expert-DP 2
    "cp2-pp2": ([*LLAMA, "--context-parallel-size", "2", *PP2], 1, "llama"),  # DP 1
    "ep2-pp2": ([*MOE, "--expert-model-parallel-size", "2", *PP2], 2, "moe"),  # expert-DP 1
}
IN_ONE = {"dp2": LLAMA, "cp2": LLAMA, "pp2-interleaved": CLIP, "ep2": MOE, "ep2-pp2": MOE}
"""Layouts whose FSDP checkpoints (at SAVE_AT) the parent resumes in one process without
FSDP: the reference's flags."""
UNITS = {"dp2": 4, "recompute-full": 5, "pp2": 2, "pp2-interleaved": 3,
         "pp2-interleaved-kept": 3}
"""FSDP units with parameters on each rank: the LLaMA-style model's embedding, 2 layers and
root (final norm and head); the tied GPT's 4 layers and the root (the embedding, final norm
and head); at PP 2 the LLaMA-style stages' embedding and layer, and layer and root (stage 0's
root holds nothing); with virtual stages the tied GPT's chunk 0's and 1's layer and one root
on each rank (the other chunk's root holds nothing). Each reduce-scatters once per global
batch."""

workdir = wiki_workdir("fsdp")


@contextlib.contextmanager
def _counting_fsdp_collectives():
    """{"reduce-scatters": n, "all-gathers": n}: the collectives FSDP2 runs in the block
    (torch.distributed's reduce_scatter_single / all_gather_single, which nothing else here
    calls), counted as they are called."""
    import torch.distributed as dist
    counts = {"reduce-scatters": 0, "all-gathers": 0}
    names = {"reduce-scatters": "reduce_scatter_single", "all-gathers": "all_gather_single"}
    real = {key: getattr(dist, name) for key, name in names.items()}

    def counted(key):
        def call(*args, **kwargs):
            counts[key] += 1
            return real[key](*args, **kwargs)
        return call
    for key, name in names.items():
        setattr(dist, name, counted(key))
    try:
        yield counts
    finally:
        for key, name in names.items():
            setattr(dist, name, real[key])


def _train(prefix, cache, *extra, mbs=2):
    """{losses, grad norms, params norms, zeros, iterations, reduce-scatters, all-gathers}
    of one run, from its history and its printed log lines (the last rank prints them)."""
    import pretrain_gpt
    out = io.StringIO()
    with contextlib.redirect_stdout(out), _counting_fsdp_collectives() as collectives:
        state = pretrain_gpt.main(tiny_gpt_argv(prefix, cache, *extra, mbs=mbs, gbs=8,
                                                iters=ITERS))
    text = out.getvalue()
    return {**collectives,
            "losses": [h["lm loss"] for h in state.history],
            "grad norms": [h.get("grad norm") for h in state.history],
            "iterations": [h["iteration"] for h in state.history],
            "params norms": [float(v) for v in re.findall(r"params norm: ([0-9.]+)", text)],
            "zeros": [float(v) for v in re.findall(r"num zeros: ([0-9.]+)", text)]}


def _train_layouts(layouts, prefix, out):
    """Each layout under FSDP for ITERS iterations, saving at SAVE_AT, and resumed from
    there: {name: run, name/resumed: run}."""
    cache, results = os.path.join(out, "cache"), {}
    for name, (flags, mbs, _) in layouts.items():
        save = os.path.join(out, f"ckpt-{name}")
        results[name] = _train(prefix, cache, *FSDP, *flags, "--save", save,
                               "--save-interval", str(SAVE_AT), mbs=mbs)
        results[name + "/resumed"] = _train(prefix, cache, *FSDP, *flags, "--load", os.path.join(
            save, f"iter_{SAVE_AT:07d}"), mbs=mbs)
    return results


def _saved_at(out, name):
    return os.path.join(out, f"ckpt-{name}", f"iter_{SAVE_AT:07d}")


def _rank2(rank, world, prefix, out):
    cache = os.path.join(out, "cache")
    bf16_save = os.path.join(out, "ckpt-bf16-fsdp")
    return {**_train_layouts(LAYOUTS2, prefix, out), **_dcp_runs(prefix, out),
        "dp2/from-one-process": _train(prefix, cache, *FSDP, *LLAMA, "--load",
                                       _saved_at(out, "llama-one"), mbs=1),
        "bf16": _train(prefix, cache, *FSDP, *LLAMA_BF16, "--no-fsdp-reshard-after-forward",
                       mbs=1),
        "bf16/first": _train(prefix, cache, *FSDP, *LLAMA_BF16, "--save", bf16_save,
                             "--save-interval", str(SAVE_AT), "--exit-interval", str(SAVE_AT),
                             mbs=1),
        "bf16/resumed": _train(prefix, cache, *FSDP, *LLAMA_BF16, "--load", bf16_save, mbs=1),
        "bf16/from-one-process": _train(prefix, cache, *FSDP, *LLAMA_BF16, "--load",
                                        _saved_at(out, "bf16-one"), mbs=1),
        # the same bf16 runs without FSDP, the references at DP 2
        "bf16/ddp": _train(prefix, cache, *LLAMA_BF16, "--save", os.path.join(out, "ckpt-bf16-ddp"),
                           "--save-interval", str(SAVE_AT), mbs=1),
        "bf16/ddp-from-one-process": _train(prefix, cache, *LLAMA_BF16, "--load",
                                            _saved_at(out, "bf16-one"), mbs=1),
    }


def _dcp_runs(prefix, out):
    """The LLaMA-style model at DP 2 under FSDP saved in torch_dcp at SAVE_AT, and resumed
    from it under FSDP."""
    cache, save = os.path.join(out, "cache"), os.path.join(out, "ckpt-dcp")
    return {"dcp/first": _train(prefix, cache, *FSDP, *LLAMA, *DCP, "--save", save,
                                "--save-interval", str(SAVE_AT), "--exit-interval", str(SAVE_AT),
                                mbs=1),
            "dcp/resumed": _train(prefix, cache, *FSDP, *LLAMA, *DCP, "--load", save, mbs=1)}


def _rank4(rank, world, prefix, out):
    """LAYOUTS4; the DP 2 FSDP checkpoint resumed at TP 2 x PP 2 with the distributed
    optimizer; that layout's own run to SAVE_AT, saved for _rank2_from_tp2_pp2."""
    cache = os.path.join(out, "cache")
    return {**_train_layouts(LAYOUTS4, prefix, out), "offsets": _uneven_shards(world),
            "tp2-pp2/from-fsdp": _train(prefix, cache, *TP2_PP2_DIST_OPT, "--load",
                                        _saved_at(out, "dp2"), mbs=1),
            "tp2-pp2/from-dcp": _train(prefix, cache, *TP2_PP2_DIST_OPT, *DCP, "--load",
                                       os.path.join(out, "ckpt-dcp"), mbs=1),
            "tp2-pp2/first": _train(prefix, cache, *TP2_PP2_DIST_OPT, "--save",
                                    os.path.join(out, "ckpt-tp2-pp2"), "--save-interval",
                                    str(SAVE_AT), "--exit-interval", str(SAVE_AT), mbs=1)}


def _rank2_from_tp2_pp2(rank, world, prefix, out):
    """The TP 2 x PP 2 distributed-optimizer checkpoint resumed under FSDP at DP 2."""
    return _train(prefix, os.path.join(out, "cache"), *FSDP, *LLAMA, "--load",
                  _saved_at(out, "tp2-pp2"), mbs=1)


def _uneven_shards(world):
    """Rows that do not divide by DP (5, 2: the last ranks' shards short or empty): the
    shard FSDP gives this rank is the whole's rows [shard_row_offset, + its length), and
    shard_start is where it begins flattened. Returns the mismatches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from megatron.distributed.fsdp import apply_fsdp  # noqa: F401 (the module under test)
    from megatron.mpu.fsdp_shards import local, shard_row_offset, shard_start
    bad = []
    for rows in (5, 2):
        torch.manual_seed(0)
        module = torch.nn.Linear(3, rows)
        whole = module.weight.detach().clone()
        fully_shard(module)
        part = local(module.weight).detach()
        at = shard_row_offset(module.weight)
        if not torch.equal(part, whole[at:at + part.shape[0]]) or \
                shard_start(module.weight) != at * 3:
            bad.append((rows, dist.get_rank(), at, tuple(part.shape)))
    return bad


def _close(got, want, tol, what):
    assert len(got) == len(want) and got, f"{what}: {got} vs {want}"
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    assert rel < tol, f"{what}: max relative difference {rel:.3g}\n{got}\n{want}"


@pytest.fixture(scope="module")
def runs(workdir):
    """The single-process references (and the checkpoint they save at SAVE_AT), then the
    spawns."""
    prefix, out = workdir
    cache = str(out / "cache")
    with one_thread():
        one = _train(prefix, cache, *CLIP, "--save", str(out / "ckpt-one"), "--save-interval",
                     str(SAVE_AT))
        bf16 = _train(prefix, cache, *LLAMA_BF16, "--save", str(out / "ckpt-bf16-one"),
                      "--save-interval", str(SAVE_AT), mbs=1)
        llama = _train(prefix, cache, *LLAMA, "--save", str(out / "ckpt-llama-one"),
                       "--save-interval", str(SAVE_AT))
        moe = _train(prefix, cache, *MOE)
    ranks2 = run_ranks(_rank2, 2, prefix, str(out), timeout=1800)
    with one_thread():
        bf16_one = _train(prefix, cache, *LLAMA_BF16, "--load", str(out / "ckpt-bf16-fsdp"),
                          mbs=1)
        bf16_one_from_ddp = _train(prefix, cache, *LLAMA_BF16, "--load",
                                   _saved_at(str(out), "bf16-ddp"), mbs=1)
    ranks4 = run_ranks(_rank4, 4, prefix, str(out), timeout=1800)
    from_tp2_pp2 = run_ranks(_rank2_from_tp2_pp2, 2, prefix, str(out), timeout=600)
    with one_thread():
        in_one = {name: _train(prefix, cache, *flags, "--load", _saved_at(str(out), name))
                  for name, flags in IN_ONE.items()}
        in_one["dcp"] = _train(prefix, cache, *LLAMA, *DCP, "--load", str(out / "ckpt-dcp"))
    return {"one": one, "bf16": bf16, "llama": llama, "moe": moe, "ranks2": ranks2,
            "bf16 one": bf16_one, "bf16 one from ddp": bf16_one_from_ddp, "ranks4": ranks4, "from tp2 pp2": from_tp2_pp2,
            "in one process": in_one,
            "bf16 keys": _saved_keys(out / "ckpt-bf16-fsdp" / f"iter_{SAVE_AT:07d}")}


def _saved_keys(directory):
    from torch.distributed.checkpoint import FileSystemReader
    return sorted(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def test_clipping_acts_at_every_step(runs):
    """--clip-grad 0.5 is below every gradient norm of both references, so each FSDP layout's
    matching gradient norms show clipping done on the sharded gradients."""
    assert min(runs["llama"]["grad norms"]) > 0.5, runs["llama"]["grad norms"]
    assert min(runs["one"]["grad norms"]) > 0.5, runs["one"]["grad norms"]


def _zeros_close(got, want, what):
    """Zero counts agree but for the few entries that round to exactly 0 in one reduction
    order and not in another (ZEROS_SLACK)."""
    assert len(got) == len(want) == ITERS, (what, got, want)
    assert all(abs(a - b) <= ZEROS_SLACK for a, b in zip(got, want)), (what, got, want)


def test_tools_read_fsdp_checkpoints(runs, workdir):
    """tools/merge_mp_partitions.py and tools/convert_checkpoint.py --to hf read the torch_dist
    checkpoint FSDP saved at DP 2 (the LLaMA-style model, at ITERS): the merged torch
    checkpoint holds its tensors exactly, and so does that one converted to torch_dcp; all
    export the same Hugging Face weights, and the names are the one-process checkpoint's."""
    from safetensors.torch import load_file

    from megatron.checkpointing import api
    from tools import convert_checkpoint, merge_mp_partitions
    _, out = workdir
    fsdp, merged = str(out / "ckpt-dp2"), str(out / "ckpt-dp2-merged")
    with one_thread():
        assert merge_mp_partitions.main(["--load", fsdp, "--save", merged]) == 0
        for load in (fsdp, merged):
            assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", load,
                                            "--save", load + "-hf"]) == 0
    sharded, whole = api.read_model(fsdp)[0], api.read_model(merged)[0]
    one = api.read_model(str(out / "ckpt-llama-one" / f"iter_{ITERS:07d}"))[0]
    assert sorted(sharded) == sorted(whole) == sorted(one)
    assert all(torch.equal(sharded[name], whole[name]) for name in sharded)
    assert all(torch.allclose(sharded[name], one[name], rtol=1e-3, atol=1e-5) for name in one)
    as_dcp = str(out / "ckpt-dp2-as-dcp")  # and through Megatron-LM's torch_dcp
    with one_thread():
        assert merge_mp_partitions.main(["--load", merged, "--save", as_dcp, "--ckpt-format",
                                         "torch_dcp"]) == 0
        assert convert_checkpoint.main(["--from", "megatron", "--to", "hf", "--load", as_dcp,
                                        "--save", as_dcp + "-hf"]) == 0
    assert api.detect(as_dcp).format.name == "torch_dcp"
    again = api.read_model(as_dcp)[0]
    assert sorted(again) == sorted(whole)
    assert all(torch.equal(again[name], whole[name]) for name in whole)
    exported = [load_file(os.path.join(load + "-hf", "model.safetensors"))
                for load in (fsdp, merged, as_dcp)]
    for other in exported[1:]:
        assert sorted(exported[0]) == sorted(other)
        assert all(torch.equal(exported[0][name], other[name]) for name in exported[0])


def _continues(got, ref, what):
    """`got` is the run resumed at SAVE_AT: its losses and gradient norms are the
    uninterrupted `ref`'s from there, within 1e-5."""
    assert got["iterations"] == list(range(SAVE_AT + 1, ITERS + 1)), (what, got["iterations"])
    _close(got["losses"], ref["losses"][SAVE_AT:], LOSS_TOL, f"{what} losses")
    _close(got["grad norms"], ref["grad norms"][SAVE_AT:], LOSS_TOL, f"{what} grad norms")


def test_one_process_checkpoint_resumes_under_fsdp(runs):
    for rank, result in enumerate(runs["ranks2"]):
        _continues(result["dp2/from-one-process"], runs["llama"], f"rank {rank}")


def test_fsdp_checkpoint_resumes_at_tp2_pp2_with_distributed_optimizer(runs):
    """FSDP at DP 2 -> TP 2 x PP 2, --use-distributed-optimizer: the last stage reports."""
    reporting = [r["tp2-pp2/from-fsdp"] for r in runs["ranks4"]
                 if r["tp2-pp2/from-fsdp"]["losses"]]
    assert len(reporting) == 2
    for rank, got in enumerate(reporting):
        _continues(got, runs["llama"], f"last stage, TP rank {rank}")


def test_tp2_pp2_distributed_optimizer_checkpoint_resumes_under_fsdp(runs):
    """TP 2 x PP 2 with the distributed optimizer (its first SAVE_AT iterations the
    reference's) -> FSDP at DP 2."""
    for r in runs["ranks4"]:
        first = r["tp2-pp2/first"]
        if first["losses"]:
            _close(first["losses"], runs["llama"]["losses"][:SAVE_AT], LOSS_TOL, "TP 2 x PP 2")
    for rank, got in enumerate(runs["from tp2 pp2"]):
        _continues(got, runs["llama"], f"rank {rank}")


def test_fsdp_bf16_equals_bf16_without_fsdp(runs):
    for rank, result in enumerate(runs["ranks2"]):
        for key in ("losses", "grad norms"):
            _close(result["bf16"][key], result["bf16/ddp"][key], LOSS_TOL,
                   f"rank {rank} bf16 {key} against DP 2 without FSDP")
            _close(result["bf16"][key], runs["bf16"][key], BF16_TOL,
                   f"rank {rank} bf16 {key} against one process")


def test_fsdp_bf16_checkpoints_resume_both_ways(runs):
    """Under FSDP exactly; across FSDP and no FSDP within 1e-5 of the run continued
    (the fp32 main params travel as optimizer.state.fp32_param, saved by both)."""
    keys = runs["bf16 keys"]
    weights = {k for k in keys if not k.startswith("optimizer.")}
    fp32 = "optimizer.state.fp32_param."
    assert "output_layer.weight" in weights, keys
    assert {k[len(fp32):] for k in keys if k.startswith(fp32)} == weights, keys
    for rank, result in enumerate(runs["ranks2"]):
        full, first, resumed = result["bf16"], result["bf16/first"], result["bf16/resumed"]
        assert first["losses"] == full["losses"][:SAVE_AT], rank
        assert resumed["losses"] == full["losses"][SAVE_AT:], f"rank {rank}: resumed run differs"
        _same_continuation(result["bf16/from-one-process"], result["bf16/ddp-from-one-process"],
                           f"rank {rank}: one-process bf16 checkpoint under FSDP")
    _same_continuation(runs["bf16 one"], runs["bf16 one from ddp"],
                       "FSDP bf16 checkpoint in one process")


def _same_continuation(got, ref, what):
    """Two runs resumed at SAVE_AT (from checkpoints of the same state) go on alike, within
    1e-5."""
    assert got["iterations"] == ref["iterations"] == list(range(SAVE_AT + 1, ITERS + 1)), what
    _close(got["losses"], ref["losses"], LOSS_TOL, f"{what} losses")
    _close(got["grad norms"], ref["grad norms"], LOSS_TOL, f"{what} grad norms")


def test_torch_dcp_checkpoints_resume_across_layouts(runs, workdir):
    """--ckpt-format torch_dcp under FSDP at DP 2: the run to SAVE_AT is the torch_dist run's
    and resumes it bit for bit under FSDP; it resumes in one process without FSDP and at
    TP 2 x PP 2 with the distributed optimizer within 1e-5; it holds the torch_dist
    checkpoint's tensors exactly (read_model, what the tools read)."""
    from megatron.checkpointing import api
    for rank, result in enumerate(runs["ranks2"]):
        full = result["dp2"]
        assert result["dcp/first"]["losses"] == full["losses"][:SAVE_AT], rank
        assert result["dcp/resumed"]["losses"] == full["losses"][SAVE_AT:], rank
    _continues(runs["in one process"]["dcp"], runs["llama"], "torch_dcp in one process")
    reporting = [r["tp2-pp2/from-dcp"] for r in runs["ranks4"] if r["tp2-pp2/from-dcp"]["losses"]]
    assert len(reporting) == 2
    for rank, got in enumerate(reporting):
        _continues(got, runs["llama"], f"torch_dcp at TP 2 x PP 2, TP rank {rank}")
    _, out = workdir
    dcp, dist = (api.read_model(path)[0] for path in (str(out / "ckpt-dcp"),
                                                      _saved_at(str(out), "dp2")))
    assert sorted(dcp) == sorted(dist)
    assert all(torch.equal(dcp[name], dist[name]) for name in dist)


def test_shard_offsets_follow_fsdp_on_uneven_rows(runs):
    assert [r["offsets"] for r in runs["ranks4"]] == [[]] * 4


def test_tp2_sp_zero_counts_hold_the_absent_tokens_rows(runs):
    """The untied embedding rows of tokens a batch lacks are exact zeros, counted once under
    TP 2 x FSDP 2 with SP (test_layout_equals_one_process compares the counts)."""
    assert min(runs["llama"]["zeros"]) > 1000, runs["llama"]["zeros"]
    assert min(runs["ranks4"][-1]["tp2-sp"]["zeros"]) > 1000


def _layout_results(runs, name):
    """(the reference's run, every rank's results) of a layout of LAYOUTS2 or LAYOUTS4."""
    world = 2 if name in LAYOUTS2 else 4
    return runs[{**LAYOUTS2, **LAYOUTS4}[name][2]], runs[f"ranks{world}"]


@pytest.mark.parametrize("name", [*LAYOUTS2, *LAYOUTS4])
def test_layout_equals_one_process(runs, name):
    """Losses and gradient norms on every rank that reports them (the last PP stage), and
    the params norm and zero count the last rank logs."""
    ref, results = _layout_results(runs, name)
    reporting = [r[name] for r in results if r[name]["losses"]]
    assert len(reporting) == (2 if "pp2" in name else len(results)), name
    for rank, got in enumerate(reporting):
        assert got["iterations"] == list(range(1, ITERS + 1)), (name, rank)
        _close(got["losses"], ref["losses"], LOSS_TOL, f"{name}: rank {rank} losses")
        _close(got["grad norms"], ref["grad norms"], LOSS_TOL, f"{name}: rank {rank} grad norms")
    last = results[-1][name]
    _close(last["params norms"], ref["params norms"], LOSS_TOL, f"{name}: params norms")
    _zeros_close(last["zeros"], ref["zeros"], f"{name}: zeros")


@pytest.mark.parametrize("name", [*LAYOUTS2, *LAYOUTS4])
def test_layout_resumes_exactly(runs, name):
    _, results = _layout_results(runs, name)
    for rank, result in enumerate(results):
        full, resumed = result[name], result[name + "/resumed"]
        if full["losses"]:
            assert resumed["iterations"] == list(range(SAVE_AT + 1, ITERS + 1)), (name, rank)
        assert resumed["losses"] == full["losses"][SAVE_AT:], f"{name}: rank {rank} differs"


@pytest.mark.parametrize("name", IN_ONE)
def test_layout_checkpoint_resumes_in_one_process_without_fsdp(runs, name):
    """The shards of every rank (DP x CP, both pipeline stages, the experts' over expert-DP
    within each EP rank's) make the whole model and optimizer state again."""
    ref, _ = _layout_results(runs, name)
    got = runs["in one process"][name]
    assert got["iterations"] == list(range(SAVE_AT + 1, ITERS + 1)), name
    _close(got["losses"], ref["losses"][SAVE_AT:], LOSS_TOL, f"{name} in one process")


@pytest.mark.parametrize("name", UNITS)
def test_gradients_reduce_scattered_once_per_global_batch(runs, name):
    """Only the backward of each chunk's last micro batch reduce-scatters (4 micro batches
    per rank here): once per unit and iteration, the pipeline schedules' included."""
    results = runs["ranks2"] if name in LAYOUTS2 else runs["ranks4"]
    assert [r[name]["reduce-scatters"] for r in results] == [UNITS[name] * ITERS] * len(results)


def test_kept_gathered_parameters_are_all_gathered_once_per_global_batch(runs):
    """--no-fsdp-reshard-after-forward: the untied LLaMA-style model's 4 units (embedding,
    2 layers, root), and under the interleaved schedule each rank's 3 (UNITS), stay gathered
    over the 4 micro batches, and are gathered once more for the validation after the last
    iteration; resharding after forward gathers far more."""
    for result in runs["ranks2"]:
        assert result["bf16"]["all-gathers"] == 4 * (ITERS + 1)
        assert result["bf16/first"]["all-gathers"] > 4 * 4 * SAVE_AT
    for result in runs["ranks4"]:
        assert result["pp2-interleaved-kept"]["all-gathers"] == 3 * (ITERS + 1)
        assert result["pp2-interleaved"]["all-gathers"] > 3 * 4 * ITERS


@pytest.mark.parametrize("flags, words", [
    (["--use-distributed-optimizer"], ["--use-torch-fsdp2", "--use-distributed-optimizer"]),
    (["--fp16"], ["--use-torch-fsdp2", "--fp16"]),
    (["--DDP-impl", "torch"], ["--use-torch-fsdp2", "--DDP-impl torch"]),
    (["--torch-compile"], ["--use-torch-fsdp2", "--torch-compile"]),
    (["--tensor-model-parallel-size", "4"], ["--use-torch-fsdp2", "context-parallel size of 1"]),
    (["--pipeline-model-parallel-size", "4"], ["--use-torch-fsdp2", "context-parallel size of 1"]),
    (["--save", "x", "--ckpt-format", "torch"], ["--ckpt-format torch", "torch_dist"]),
    (["--load", "x", "--ckpt-format", "torch"], ["--ckpt-format torch", "torch_dist"]),
])
def test_unsupported_combinations_are_one_line(flags, words, capsys):
    from megatron.arguments import parse_args
    argv = tiny_gpt_argv("data", "cache", *FSDP, *flags, mbs=1)
    assert_exits_2_with_one_line(capsys, lambda: parse_args(argv, world_size=4), words)
