"""Paged attention behind transformers' attention-function interface (paged.py), through one of its backends:
the CPU C kernel (paged_attention.c), compiled FlexAttention (flex.py) and Triton kernels for CUDA."""

from .paged import (ATTN_NAME, BACKENDS, DECODE_MODES, KERNEL_REFERENCE, KERNEL_REFERENCE_F16, PrefillChunk, Span,
                    StepContext, build_context, choose_backend, choose_decode_attention, current_context,
                    kernel_reference, padded_tables, paged_attention, register, set_context, triton_available)

__all__ = ["ATTN_NAME", "BACKENDS", "DECODE_MODES", "KERNEL_REFERENCE", "KERNEL_REFERENCE_F16", "PrefillChunk",
           "Span", "StepContext", "build_context", "choose_backend", "choose_decode_attention", "current_context",
           "kernel_reference", "padded_tables", "paged_attention", "register", "set_context", "triton_available"]
