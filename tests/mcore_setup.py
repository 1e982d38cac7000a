"""Megatron-Core 0.16.1 as a reference implementation (../shared/references.md): the one
way tests reach it (torch_dist checkpoints, the MoE layer, the whole training step).

Megatron-Core installs a namespace package `megatron` (with only `megatron/core`), which our
own `megatron` package shadows. `import_mcore()` appends the installed directory to our
package's `__path__`, so `megatron.core` resolves to the installed one and everything else
to ours, and a test compares both in one process; only processes that call it see
`megatron.core` (our package defines no `core`). It then applies the CPU monkeypatches that
the dense GPT model, `dist_checkpointing`, the MoE layer with the allgather dispatcher and
the torch norm under sequence parallelism need (items 1-5 and 8 of references.md; no test
here uses the alltoall dispatcher, items 6-7). `cpu_devices()` is item 9: the context in
which Megatron-Core's pipeline schedules and optimizers allocate on the CPU. The patches
replace torch.cuda functions process-wide: call it in spawned ranks
(tests/distributed/run_ranks.py) after init_process_group, never in the pytest process.
"""
import contextlib
import importlib.metadata
import os

import torch


def mcore_dir():
    """The installed `megatron` directory of megatron-core 0.16.1, or None."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = os.path.join(str(dist.locate_file("")), "megatron")
    return path if dist.version == "0.16.1" and os.path.isdir(os.path.join(path, "core")) \
        else None


def run_mcore_script(script: str, payload=None):
    """Run `script` in a child Python that sees Megatron-Core's `megatron.core` beside our
    package (without the CPU patches; for pure code such as TransformerConfig's checks, the
    rank math or the expert-bias update) and return the JSON it prints last; `payload` goes
    to its stdin as JSON. Importing megatron.core changes our package's path, so never in
    the pytest process."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prelude = f"import megatron\nmegatron.__path__.append({mcore_dir()!r})\n"
    env = dict(os.environ, PYTHONPATH=root, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", prelude + script], capture_output=True,
                          text=True, env=env, timeout=300, input=json.dumps(payload))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def import_mcore():
    import megatron
    path = mcore_dir()
    if path not in megatron.__path__:
        megatron.__path__.append(path)
    import megatron.core  # noqa: F401
    _patch_cpu()
    return megatron.core


def _patch_cpu() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer import utils
    from megatron.core.transformer.moe import moe_utils
    torch.cuda.current_device = lambda: torch.device("cpu")  # 1: allocation device
    moe_utils.te_general_gemm = None  # 5: the router's Transformer Engine path

    def causal(sq):
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    utils.get_default_causal_mask = causal  # 3: masks on CPU
    fused_softmax.get_default_causal_mask = causal
    torch.cuda.synchronize = lambda *a, **k: None  # 4: dist_checkpointing's synchronize

    class CpuTracker(mc_random.CudaRNGStatesTracker):  # 2: no CUDA RNG states
        @contextlib.contextmanager
        def fork(self, name=None):
            yield

        def add(self, name, seed):
            pass
    tracker = CpuTracker()
    mc_random._CUDA_RNG_STATE_TRACKER = tracker
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mc_random.get_cuda_rng_tracker = lambda *a, **k: tracker
    tensor_parallel.get_cuda_rng_tracker = mc_random.get_cuda_rng_tracker
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None
    _patch_torch_norm()


def _patch_torch_norm() -> None:
    """8: Megatron-Core's torch norm (the local spec's) asserts against sequence parallelism;
    build it from the config without it, and tag its parameters `sequence_parallel` as
    Transformer Engine's norm does, so that finalize_model_grads sums their partial
    gradients over TP."""
    import dataclasses
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    build = WrappedTorchNorm.__new__
    if getattr(build, "patched", False):
        return

    def new(cls, config, *args, **kwargs):
        norm = build(cls, dataclasses.replace(config, sequence_parallel=False), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
    new.patched = True
    WrappedTorchNorm.__new__ = new


def patch_mla() -> None:
    """Multi-latent attention from the local spec on CPU (references.md, items 10-11):
    10. MLASelfAttention hands its core attention `k_channels` / `v_channels`, which the
        local DotProductAttention does not take: accept them, and size its output by the
        value head size (v_head_dim, not kv_channels);
    11. `multi_latent_attention.HAVE_TE` is True without Transformer Engine (the import of
        its extension module succeeds with None placeholders), and `isinstance(...,
        TELinear)` then fails: set it False."""
    from megatron.core.transformer import dot_product_attention, multi_latent_attention
    multi_latent_attention.HAVE_TE = False
    cls = dot_product_attention.DotProductAttention
    if getattr(cls.__init__, "patched", False):
        return
    init = cls.__init__

    def new_init(self, *args, k_channels=None, v_channels=None, **kwargs):
        init(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
    new_init.patched = True
    cls.__init__ = new_init


def mcore_gpt(tp: int, layers: int, hidden: int, heads: int, vocab: int, seq: int,
              activation_func=None, **model_kwargs):
    """A Megatron-Core GPTModel (local spec, dropout 0, CPU init) at TP `tp`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, tensor_model_parallel_size=tp,
                            params_dtype=torch.float32,
                            **({"activation_func": activation_func} if activation_func else {}))
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq,
                    **model_kwargs)


class _CpuDevices(torch.overrides.TorchFunctionMode):
    """references.md item 9 (and the optimizer's like it): tensors Megatron-Core allocates
    with device="cuda" (the pipeline schedules, the optimizers' scalars, the distributed
    optimizer's buffers) or moves with .cuda() stay on the CPU, and `Tensor.type()` reports
    the CUDA name its gradient clipping asserts."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or \
        (isinstance(device, torch.device) and device.type == "cuda")


def cpu_devices():
    """A context in which Megatron-Core's CUDA allocations land on the CPU (run its
    training step, schedules and optimizers inside it; after import_mcore)."""
    return _CpuDevices()
