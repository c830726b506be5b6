"""DRY ("don't repeat yourself"): a penalty on each token that would extend a run already seen in the context."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.engine.transfer import upload

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")   # llama.cpp's and text-generation-webui's defaults
FLOAT_MAX_LOG = 88.7228391                   # log of float32's largest value: the exponent is capped below it
_CHECK_EVERY = 4                             # match steps between looks at whether any run is still going


@dataclass(frozen=True)
class Breakers:
    """A set of sequence breakers as token ids: a repeated run is never counted across one of them."""

    heads: tuple[int, ...]                     # tokens whose text contains a breaker
    sequences: tuple[tuple[int, ...], ...]     # a breaker's own tokens, where it takes more than one


NO_BREAKERS = Breakers((), ())
BreakerResolver = Callable[[tuple[str, ...]], Breakers]


class BreakerTokens:
    """Breaker strings to token ids for one tokenizer: each set of strings is looked up once.

    A breaker counts wherever a token's text contains it whole (as llama.cpp's heads with no tail), and where its
    own tokenization appears as a run of tokens. llama.cpp also counts a token that ends with the start of a
    breaker followed by the rest's tokens; that case is not looked for here."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: list[str] | None = None
        self._sets: dict[tuple[str, ...], Breakers] = {}
        self._lock = threading.Lock()

    def texts(self) -> list[str]:
        """Every token's own text, decoded once (a fraction of a second for a 50k vocabulary)."""
        if self._texts is None:
            ids = [[i] for i in range(len(self.tokenizer))]
            self._texts = self.tokenizer.batch_decode(ids, skip_special_tokens=False,
                                                      clean_up_tokenization_spaces=False)
        return self._texts

    def __call__(self, strings: tuple[str, ...]) -> Breakers:
        found = self._sets.get(strings)
        if found is not None:
            return found
        with self._lock:
            if strings not in self._sets:
                texts = self.texts()
                heads = sorted({i for i, text in enumerate(texts) if any(s in text for s in strings)})
                sequences = set()
                for s in strings:
                    ids = tuple(self.tokenizer.encode(s, add_special_tokens=False))
                    if len(ids) > 1:
                        sequences.add(ids)
                self._sets[strings] = Breakers(tuple(heads), tuple(sorted(sequences)))
            return self._sets[strings]


@dataclass
class DryRows:
    """The batch's DRY rows and their parameters as [D, 1] tensors; built with the rest of RowParams."""

    rows: list[int]                  # rows of the batch with DRY on
    wanted: list[bool]               # the same, one flag per row of the batch
    index: torch.Tensor | None       # int64 [D] of those rows; None when every row has DRY
    row_ids: torch.Tensor            # int64 [D, 1]: the same rows, as a column
    multiplier: torch.Tensor         # float32 [D, 1]
    base: torch.Tensor               # float32 [D, 1]
    allowed: torch.Tensor            # int64 [D, 1]
    max_exponent: torch.Tensor       # float32 [D, 1]: the exponent's cap, inf where the base is 1
    allowed_host: list[int]
    last_n: list[int]                # the window in tokens, -1 for the whole context
    include_prompt: list[bool]       # False: the window starts at the answer
    tables: torch.Tensor             # bool [S, vocab + 1]: each breaker set's heads (the last column: padding)
    table_of: torch.Tensor           # int64 [D, 1]: the set of each row
    sequences: list[tuple[torch.Tensor, torch.Tensor]]   # (int64 ids [m], bool [D, 1] rows that use them)

    @classmethod
    def build(cls, params: Sequence, vocab: int, device: torch.device,
              resolve: BreakerResolver | None) -> DryRows | None:
        rows = [i for i, p in enumerate(params) if p.dry]
        if not rows:
            return None
        sets: dict[Breakers, int] = {}
        table_of = []
        for i in rows:
            strings = tuple(params[i].dry_sequence_breakers)
            if strings and resolve is None:
                raise ValueError("DRY sequence breakers need a tokenizer: give the Sampler a breaker resolver")
            breakers = resolve(strings) if strings else NO_BREAKERS
            table_of.append(sets.setdefault(breakers, len(sets)))
        tables = torch.zeros(len(sets), vocab + 1, dtype=torch.bool)
        sequences = []
        for breakers, s in sets.items():
            heads = [t for t in breakers.heads if 0 <= t < vocab]
            if heads:
                tables[s, heads] = True
            for seq in breakers.sequences:
                users = [s == t for t in table_of]
                sequences.append((upload(list(seq), torch.int64, device), upload(users, torch.bool, device)[:, None]))
        dry = [params[i] for i in rows]
        column = dict(dtype=torch.float32, device=device)
        bases = [float(p.dry_base) for p in dry]
        return cls(
            rows=rows,
            wanted=[p.dry for p in params],
            index=None if len(rows) == len(params) else upload(rows, torch.int64, device),
            row_ids=upload(rows, torch.int64, device)[:, None],
            multiplier=upload([float(p.dry_multiplier) for p in dry], **column)[:, None],
            base=upload(bases, **column)[:, None],
            allowed=upload([p.dry_allowed_length for p in dry], torch.int64, device)[:, None],
            max_exponent=upload([FLOAT_MAX_LOG / math.log(b) if b > 1.000001 else float("inf") for b in bases],
                                **column)[:, None],
            allowed_host=[p.dry_allowed_length for p in dry],
            last_n=[p.dry_penalty_last_n for p in dry],
            include_prompt=[p.dry_include_prompt for p in dry],
            tables=tables.to(device),
            table_of=upload(table_of, torch.int64, device)[:, None],
            sequences=sequences,
        )


def run_lengths(ids: torch.Tensor, first: torch.Tensor, last: torch.Tensor, limit: torch.Tensor,
                lo: int) -> torch.Tensor:
    """For each position j of each row (columns of `ids` are positions lo, lo + 1, ...): the length of the longest
    run of tokens ending at j that equals the run ending at the row's last token, counting only tokens in
    [first, last], and at most `limit` (the tokens since the last breaker) or `last - j`. int64, 0 at j >= last.

    One comparison of the whole window per token of the longest run, stopping when no run is still going."""
    width = ids.shape[1]
    pos = torch.arange(lo, lo + width, device=ids.device)
    inside = (pos >= first) & (pos <= last)
    left = ids.masked_fill(~inside, -1)     # what candidate runs read
    right = ids.masked_fill(~inside, -2)    # what the last run reads: never equal outside the window
    alive = inside & (pos < last)
    lengths = torch.zeros_like(ids)
    end = last - lo                          # the last token's column
    for k in range(width):
        ref = right.gather(1, (end - k).clamp(min=0))
        step = alive[:, k:]
        step &= left[:, :width - k] == ref
        step &= k < limit
        alive[:, :k] = False
        lengths += alive
        if (k + 1) % _CHECK_EVERY == 0 and not bool(alive.any()):
            break
    return lengths


def since_breaker(ids: torch.Tensor, first: torch.Tensor, last: torch.Tensor, dry: DryRows, lo: int) -> torch.Tensor:
    """Tokens after the last breaker in each row's window, up to its last token ([D, 1]; the window's length where
    there is none): llama.cpp's repetition limit."""
    width = ids.shape[1]
    pos = torch.arange(lo, lo + width, device=ids.device)
    inside = (pos >= first) & (pos <= last)
    ends = dry.tables[dry.table_of, ids] & inside
    window = ids.masked_fill(~inside, -1)
    for seq, users in dry.sequences:
        m = seq.shape[0]
        if m > width:
            continue
        match = users.expand(-1, width - m + 1).clone()
        for i in range(m):
            match &= window[:, i:width - m + 1 + i] == seq[i]
        ends[:, m - 1:] |= match
    last_end = torch.where(ends, pos, -1).amax(dim=1, keepdim=True)
    return last - torch.maximum(last_end, first - 1)


def dry_penalise_(padded: torch.Tensor, ids: torch.Tensor, lengths: Sequence[int], dry: DryRows,
                  prompt_lens: Sequence[int] | None = None) -> None:
    """DRY in place on [rows, vocab + 1] scores, for the DRY rows only. ids: the batch's histories ([rows, width],
    padded; lengths: each history's length; prompt_lens: where each answer starts, None: all answer). A token that would extend a run of n >= allowed tokens that already
    occurred in the window loses multiplier * base ** (n - allowed) (the exponent capped so the power stays
    finite); a token that would extend several runs loses the longest one's."""
    sizes = [lengths[r] for r in dry.rows]
    firsts = [max(0, n - w) if w > 0 else 0 for n, w in zip(sizes, dry.last_n)]
    if prompt_lens is not None:
        firsts = [f if whole else max(f, prompt_lens[r]) for f, whole, r in zip(firsts, dry.include_prompt, dry.rows)]
    if all(n - f <= a for n, f, a in zip(sizes, firsts, dry.allowed_host)):
        return   # no window holds a run longer than its allowed length
    lo, hi = min(firsts), max(sizes)
    rows = ids if dry.index is None else ids.index_select(0, dry.index)
    window = rows[:, lo:hi]
    device = ids.device
    first = upload(firsts, torch.int64, device)[:, None]
    last = upload([n - 1 for n in sizes], torch.int64, device)[:, None]
    limit = since_breaker(window, first, last, dry, lo)
    runs = run_lengths(window, first, last, limit, lo)[:, :-1]
    follows = window[:, 1:]                  # the token after each run's end
    vocab1 = padded.shape[1]
    eligible = runs >= dry.allowed
    exponent = (runs - dry.allowed).to(torch.float32).clamp_(min=0.0)
    exponent = torch.minimum(exponent, dry.max_exponent)
    flat = dry.row_ids * vocab1 + torch.where(eligible, follows, vocab1 - 1)
    scores = padded.view(-1)
    lowered = scores[flat] - dry.multiplier * dry.base.pow(exponent)
    scores.scatter_reduce_(0, flat.reshape(-1), lowered.reshape(-1), reduce="amin", include_self=True)
