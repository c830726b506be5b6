"""Log-probabilities of chosen tokens and their best alternatives, for many rows in a fixed number of tensor ops."""

from __future__ import annotations

import torch

from .outputs import TokenLogprob


def pack(logits: torch.Tensor, targets: torch.Tensor, top: int) -> torch.Tensor:
    """Per row of `logits` [N, V]: the target token's log-probability, its rank (1 + the tokens strictly more
    likely) and the `top` most likely tokens, as one float64 tensor [N, 2 + 2 * top] (ids are exact in float64),
    so one read-back brings everything. The distribution is the logits' own: log_softmax, nothing else."""
    scores = logits.float().log_softmax(dim=-1)
    chosen = scores.gather(1, targets.view(-1, 1))
    rank = (scores > chosen).sum(dim=-1, keepdim=True) + 1
    parts = [chosen.double(), rank.double()]
    if top:
        best, ids = scores.topk(top, dim=-1)
        parts += [ids.double(), best.double()]
    return torch.cat(parts, dim=1)


def unpack(token_id: int, row: list[float], top: int, width: int) -> TokenLogprob:
    """One packed row (`width` alternatives in it) as a TokenLogprob with the first `top` alternatives."""
    ids, values = row[2:2 + width], row[2 + width:2 + 2 * width]
    return TokenLogprob(token_id=token_id, logprob=row[0], rank=int(row[1]),
                        top=[(int(i), v) for i, v in zip(ids[:top], values[:top])])
