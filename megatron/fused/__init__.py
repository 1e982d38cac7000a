"""Fused operations used by the transformer, each with a plain-PyTorch path.

The kernels live in `csrc/fused` (C++ for CPU, CUDA for GPUs) and are built on first
use by `kernels`. Each call picks the fused kernel when it is built and the inputs meet
its constraints, else the plain PyTorch path (also the reference the kernels are tested
against). `fusion=False` always takes the plain path.

This package only re-exports; each concept has its module, whose docstring gives its
kernels' constraints:
  softmax      attention_softmax (scaled, causal and / or masked), its autograd Functions
               and softmax_kernel_for (which kernel applies)
  norms        layer_norm and rms_norm, the LayerNorm and RMSNorm modules, their autograd
               Functions, fused_layer_norm, the *_fusable and layer_norm_preferred checks
  elementwise  bias_gelu (FusedBiasGeLU), dropout, bias_dropout_add, exp_sum_, the
               bfloat16 cross entropy's max_exp_sum and softmax_minus_target_, and
               add_to_float_ (a bfloat16 gradient into its float32 accumulator)
  attention    the CPU causal self-attention kernel (causal_attention, the ring-attention
               blocks, the dropout mask and seed), the path auto runs instead
               (plain_causal_attention) and auto's choice (causal_attention_preferred)
  choice       which path an op takes where both apply (--fused-kernels-choice): measured
               per shape bucket, cached on disk, agreed across ranks at model build
  paths        what those share: KERNEL_DTYPES, MAX_ROW_LENGTH, the loaded extension, the CPU
               kernels' instruction set (cpu_kernels_isa), the log lines (announce)
  kernels      building and loading the extensions

A name is looked up in the module that uses it: to patch one (a test), patch it there
(`norms.layer_norm_preferred`, `paths._ANNOUNCED`, `choice.time_pair`), not on this package.
"""
from megatron.fused.attention import (KERNEL_MAX_SEQ, KERNEL_WITH_DROPOUT, MAX_DROPOUT_SEQ,
                                      FusedCausalAttention, attention_dropout_keep,
                                      attention_dropout_seed, attention_with_lse,
                                      attention_with_lse_backward, causal_attention,
                                      causal_attention_fusable, causal_attention_preferred,
                                      plain_causal_attention)
from megatron.fused.elementwise import (FusedBiasGeLU, add_to_float_, bias_dropout_add,
                                        bias_gelu, bias_gelu_fusable, dropout, exp_sum_,
                                        max_exp_sum, softmax_grad_fusable,
                                        softmax_minus_target_)
from megatron.fused.norms import (FusedLayerNormAffine, FusedRMSNormAffine, LayerNorm, RMSNorm,
                                  fused_layer_norm, layer_norm, layer_norm_fusable,
                                  layer_norm_preferred, rms_norm, rms_norm_fusable)
from megatron.fused.paths import KERNEL_DTYPES, MAX_ROW_LENGTH, announce, cpu_kernels_isa
from megatron.fused.softmax import (MASKED, MASKED_VALUE, UPPER_TRIANG, ScaledMaskedSoftmax,
                                    ScaledUpperTriangMaskedSoftmax, attention_softmax,
                                    softmax_kernel_for)

__all__ = [
    # softmax
    "MASKED", "MASKED_VALUE", "UPPER_TRIANG", "ScaledMaskedSoftmax",
    "ScaledUpperTriangMaskedSoftmax", "attention_softmax", "softmax_kernel_for",
    # norms
    "FusedLayerNormAffine", "FusedRMSNormAffine", "LayerNorm", "RMSNorm", "fused_layer_norm",
    "layer_norm", "layer_norm_fusable", "layer_norm_preferred", "rms_norm", "rms_norm_fusable",
    # elementwise
    "FusedBiasGeLU", "add_to_float_", "bias_dropout_add", "bias_gelu", "bias_gelu_fusable",
    "dropout", "exp_sum_", "max_exp_sum", "softmax_grad_fusable", "softmax_minus_target_",
    # attention
    "KERNEL_MAX_SEQ", "KERNEL_WITH_DROPOUT", "MAX_DROPOUT_SEQ", "FusedCausalAttention",
    "attention_dropout_keep", "attention_dropout_seed", "attention_with_lse",
    "attention_with_lse_backward", "causal_attention", "causal_attention_fusable",
    "causal_attention_preferred", "plain_causal_attention",
    # paths
    "KERNEL_DTYPES", "MAX_ROW_LENGTH", "announce", "cpu_kernels_isa",
]
