"""Linears that read the same input (q/k/v, gate/up) as one matmul in compiled layers: stacked weights, one call.

`merge_linears` stacks each sibling set's weights into one matrix and puts a `Member` in each linear's place; the
original linears keep their weights as views of that matrix (no copy is held) and come back with
`unmerge_linears`. Eagerly a member multiplies by its own rows of the stack, as the linear did. Compiling, every
member of a set multiplies by the whole stack and takes its columns; the identical products are then one
(`StackedMatmuls`, a pass over the compiled graph), so a layer runs one matmul for q, k and v and one for gate
and up: fewer launches, and the weights read in one pass at small row counts. w8a8's linears are stacked already
(weights/quantised.Int8Matmul): compiling, each member asks for the whole product through its registered operator,
and the same pass keeps one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Stack(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


class Member(nn.Module):
    """Columns [start, end) of a stack's product."""

    def __init__(self, stack: Stack, start: int, end: int, original: nn.Linear) -> None:
        super().__init__()
        self.stack, self.start, self.end = stack, start, end
        self.in_features, self.out_features = original.in_features, original.out_features
        self.__dict__["original"] = original   # outside the module tree: put back by unmerge_linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.stack.weight, self.stack.bias
        if torch.compiler.is_compiling():   # one product for every member of the stack (StackedMatmuls)
            return F.linear(x, weight, bias)[..., self.start:self.end]
        return F.linear(x, weight[self.start:self.end], None if bias is None else bias[self.start:self.end])


def merge_linears(model: nn.Module) -> int:
    """Stack every sibling set of plain nn.Linear (same input width, dtype, device, all with bias or none);
    returns the number of sets stacked."""
    count = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(m) is nn.Linear for m in linears):
                continue
            first = linears[0]
            if any(m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
                   or m.weight.device != first.weight.device or (m.bias is None) != (first.bias is None)
                   for m in linears):
                continue
            with torch.no_grad():
                weight = torch.cat([m.weight for m in linears])
                bias = torch.cat([m.bias for m in linears]) if first.bias is not None else None
            stack, start = Stack(weight, bias), 0
            for name, linear in zip(names, linears):
                end = start + linear.out_features
                linear.weight = nn.Parameter(stack.weight.data[start:end], requires_grad=False)
                if bias is not None:
                    linear.bias = nn.Parameter(stack.bias.data[start:end], requires_grad=False)
                setattr(parent, name, Member(stack, start, end, linear))
                start = end
            count += 1
    return count


def unmerge_linears(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Member):
                setattr(parent, name, child.original)


class StackedMatmuls:
    """A pass over the compiled graph that keeps one of each set of identical products and the views they read
    (the members of a stack each ask for the whole product while tracing)."""

    PURE = ("mm", "addmm", "permute", "t", "view", "_unsafe_view", "reshape", "expand")

    def __call__(self, graph: torch.fx.Graph) -> None:
        from . import quantised  # noqa: F401  (registers supportbot::w8a8_matmul, a pure product too)

        targets = {getattr(torch.ops.aten, name).default for name in self.PURE}
        targets.add(torch.ops.supportbot.w8a8_matmul.default)
        seen: dict = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in targets:
                continue
            key = (node.target, _frozen(node.args), _frozen(node.kwargs))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> str:
        return "supportbot-stacked-matmuls-2"


def _frozen(value):
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def graph_pass():
    """StackedMatmuls as inductor takes a custom pass (a CustomGraphPass, so compiled graphs stay cacheable), or
    None where this torch has no such hook."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None

    class Pass(StackedMatmuls, CustomGraphPass):
        pass

    return Pass()
