"""Decoder layers compiled with torch.compile (inductor) for decode steps: one compiled code shared by every layer.

Eagerly a decode step launches about 60 kernels a layer (RMSNorm and rotary alone are eight to ten each). The
compiler fuses the elementwise work between the matmuls; attention is one registered operator
(attention/ops.py) that takes the step's buffers as arguments, so a layer is one graph with no break. Layers are
compiled, not the whole model: they are the same code with other weights, so one compilation serves all of them
(the layer index, which picks the layer's part of the pool, stays symbolic), and a model of 28 layers compiles
as fast as one of 2. The row count is symbolic too: every decode bucket runs the same compiled code, and each
bucket's CUDA graph is captured from it (device.DecodeGraphs). q/k/v and gate/up run as one matmul each
(weights/merged.py).

A layer runs compiled when called with a step's buffers: a decode step's (`engine_tables`, through
paged_decode) or an eager step's plan (`engine_plan`, prefill chunks and mixed steps through paged_chunks, the
token count symbolic too), or on CPU any step's rows (`engine_rows`, through the C kernel's paged_kernel; w8a8
linears through their registered matmul); called without them it runs the model's own code.
"""

from __future__ import annotations

import logging

import torch

from .weights import merged

log = logging.getLogger(__name__)

# A step's buffers, one of which a call carries to run compiled: a decode step's block tables (Triton), an eager
# step's plan (Triton) or a CPU step's rows (the C kernel)
STEP_ARGUMENTS = frozenset(("engine_tables", "engine_plan", "engine_rows"))


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers, where it has one (Llama, Qwen, Mistral and their kin)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


class CompiledLayers:
    """Swaps each decoder layer's forward for the compiled one while held; `release` puts the model back."""

    def __init__(self, model) -> None:
        layers = decoder_layers(model)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no list of decoder layers (model.model.layers)")
        from .weights.packed import PackedLinear

        if any(isinstance(m, PackedLinear) for m in model.modules()):
            raise ValueError("oneDNN-packed CPU linears do not compile (EngineConfig.pack_cpu_linears=False to try)")
        kinds = {type(layer) for layer in layers}
        if len(kinds) != 1:
            raise ValueError(f"the decoder layers are of {len(kinds)} kinds; one compiled forward serves one")
        self.layers = layers
        self.model = model
        # q/k/v and gate/up as one matmul each in the compiled code (weights/merged.py)
        self.graph_pass = merged.graph_pass()
        self.stacks = merged.merge_linears(layers) if self.graph_pass is not None else 0
        self.compiled = torch.compile(next(iter(kinds)).forward, fullgraph=True)
        for layer in layers:
            layer.forward = self._forward_of(layer)

    def _forward_of(self, layer):
        eager = layer.forward
        compiled = self.compiled

        def forward(hidden_states, *args, **kwargs):
            if not STEP_ARGUMENTS.intersection(kwargs):
                return eager(hidden_states, *args, **kwargs)
            # Row counts, sequences and table widths vary from step to step: symbolic from the first compilation
            # on, never specialised.
            torch._dynamo.maybe_mark_dynamic(hidden_states, 1)
            for t in kwargs.get("position_embeddings") or ():
                torch._dynamo.maybe_mark_dynamic(t, 1)
            for name in ("engine_slots", "engine_tables", "engine_lens"):
                if name in kwargs:
                    torch._dynamo.maybe_mark_dynamic(kwargs[name], 0)
            for t in (*kwargs.get("engine_plan", ()), *kwargs.get("engine_rows", ())):
                for dim in range(t.dim()):
                    torch._dynamo.maybe_mark_dynamic(t, dim)
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True), \
                    torch._inductor.config.patch(post_grad_custom_pre_pass=self.graph_pass):
                return compiled(layer, hidden_states, *args, **kwargs)

        return forward

    def release(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        merged.unmerge_linears(self.layers)
