"""Next-token selection for the whole batch on the device: per-row processors and seeded draws in a fixed number of kernels."""

from __future__ import annotations

import functools
import logging
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from worker.engine import native
from worker.engine.dry import BreakerResolver, DryRows, dry_penalise_
from worker.engine.logprobs import pack as pack_logprobs
from worker.engine.sampling_params import SamplingParams
from worker.engine.transfer import upload

# On CPU, where reading a tensor on the host costs nothing, the top-k/top-p cut-off is looked for among this many
# best tokens first (a partial sort), and only rows whose cut-off or kept tokens lie further down are redone over the
# whole row (EngineConfig.sampler_candidates; 0 takes the device path on CPU too). On a device nothing is read on
# the host in the middle of a step unless sampler_candidates asks for the same search there: a top-k cut-off is
# found among the best max(k) + 1 tokens, and only a top-p row without a top-k sorts its whole row.
log = logging.getLogger(__name__)
CPU_CANDIDATES = 256
MAX_CANDIDATES = 1024
_M32 = 0xFFFFFFFF


def random_seed() -> int:
    """A seed for a request that brought none: its draws are then still random, and still batch-independent."""
    return secrets.randbits(63)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with n choices: the request's own for the first, and one derived
    from it for the others, so a seeded request's choices are reproducible and differ from each other."""
    if index == 0:
        return seed
    a, b = seed_keys(seed)
    hi = mix32(a ^ mix32(index & _M32))
    lo = mix32(b ^ mix32(hi ^ 0x27D4EB2F))
    return ((hi << 31) ^ lo) & (2**63 - 1)


# ---- counter-based randomness: one uniform per (seed, position), the same in any batch ------------------------

def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x < 2**32, without overflowing int64 (works on ints and int64 tensors)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def mix32(x):
    """A 32-bit integer hash (Wellons' lowbias32); x must lie in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=4096)
def seed_keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys from a 63-bit seed, on the host; kept for the last 4,096 seeds, as the batch's per-row tensors
    are rebuilt whenever a request joins or leaves."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    a = mix32(lo ^ mix32(hi ^ 0x9E3779B9))
    return a, mix32(a ^ 0x85EBCA6B)


def uniforms(key_a: torch.Tensor, key_b: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One float32 in [0, 1) per row from its keys and the position of the token being drawn."""
    h = mix32(mix32((positions & _M32) ^ key_a) ^ key_b)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def race(scores: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, key_a: torch.Tensor,
         key_b: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax(scores / T + g), g a Gumbel variate per token, which is an exact draw from
    softmax(scores / T) (the Gumbel-max trick) in one pass over the row; greedy rows take argmax(scores).

    Token j's variate at a row's position comes from a hash of (seed, position, j), so a draw does not depend on
    the batch. It is g = -log(E) with E = -log1p(-v) and v = (hash + 1/2) / 2**32: small v keep their relative
    precision in float32, so the variates that win (small E) are exact to about 23 (a truncation at probability
    1e-10 per token)."""
    vocab = scores.shape[1]
    ids = torch.arange(vocab, device=scores.device)
    row = mix32((positions & _M32) ^ key_a)
    h = mix32(mix32(row[:, None] ^ ids) ^ key_b[:, None])
    v = (h.to(torch.float32) + 0.5) * (1.0 / 2**32)
    gumbel = -torch.log(-torch.log1p(-v))
    x = scores.float() / temperature + torch.where(greedy[:, None], 0.0, gumbel)
    return x.argmax(dim=-1)


_race_compiled = None


def race_compiled(*args) -> torch.Tensor:
    """`race` as one fused kernel (inductor): eagerly it is about twenty passes over [rows, vocab]. Where it does
    not compile, `race` runs eagerly (logged once): the same draws, slower."""
    global _race_compiled
    if _race_compiled is None:
        _race_compiled = torch.compile(race, dynamic=True)
    if _race_compiled is race:
        return race(*args)
    try:
        return _race_compiled(*args)
    except Exception:
        log.exception("the sampler's fused draw did not compile; drawing with eager operations")
        _race_compiled = race
        return race(*args)


# ---- per-row parameters, built once per set of requests ----------------------------------------------------------

@dataclass
class Bias:
    """Every row's logit_bias as three flat tensors (a sparse [rows, vocab] table): scores[rows, ids] += values."""

    rows: torch.Tensor     # int64 [E]
    ids: torch.Tensor      # int64 [E]
    values: torch.Tensor   # float32 [E]


@dataclass
class RowParams:
    """The batch's sampling parameters as [rows, 1] tensors, plus what the host must know to pick kernels."""

    greedy: torch.Tensor        # bool [R]
    temperature: torch.Tensor   # float32 [R, 1], 1 for greedy rows
    top_k: torch.Tensor         # int64 [R, 1], the vocab size where off
    top_p: torch.Tensor         # float32 [R, 1], inf where off
    penalty: torch.Tensor       # float32 [R, 1], 1 where off
    presence: torch.Tensor      # float32 [R, 1], 0 where off
    frequency: torch.Tensor     # float32 [R, 1], 0 where off
    log_min_p: torch.Tensor     # float32 [R, 1]: log(min_p), -inf where off and for greedy rows
    restricted: torch.Tensor    # bool [R, 1]: a sampled row with top-k or top-p
    has_top_k: torch.Tensor     # bool [R, 1]
    key_a: torch.Tensor         # int64 [R]
    key_b: torch.Tensor         # int64 [R]
    bias: Bias | None
    dry: DryRows | None         # the rows with DRY, None when no row has it
    penalised: list[bool]
    counted: list[bool]         # rows with a presence or frequency penalty (over their generated tokens)
    logprob_rows: list[int]     # rows that report their sampled tokens' log-probabilities
    logprob_index: torch.Tensor | None   # int64 [len(logprob_rows)], None when no row does
    max_logprobs: int
    all_greedy: bool
    any_greedy: bool
    any_penalty: bool
    any_counted: bool
    any_temperature: bool
    any_filter: bool
    any_min_p: bool
    any_top_p: bool
    any_top_p_without_top_k: bool
    max_top_k: int

    @property
    def any_processor(self) -> bool:
        """A processor that changes the scores greedy rows take their argmax of."""
        return self.any_penalty or self.any_counted or self.bias is not None or self.dry is not None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], vocab: int,
              device: torch.device, breakers: BreakerResolver | None = None,
              biases: BiasCache | None = None) -> RowParams:
        """breakers: DRY's sequence breakers to token ids (the engine's tokenizer); biases: the requests' logit_bias
        tensors, kept from the last build."""
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [min(p.top_k, vocab) if not g and p.top_k > 0 else vocab for p, g in zip(params, greedy)]
        top_p_on = [not g and p.top_p < 1.0 for p, g in zip(params, greedy)]
        top_p = [float(p.top_p) if on else float("inf") for p, on in zip(params, top_p_on)]
        penalty = [float(p.repetition_penalty) for p in params]
        presence = [float(p.presence_penalty) for p in params]
        frequency = [float(p.frequency_penalty) for p in params]
        counted = [a != 0.0 or b != 0.0 for a, b in zip(presence, frequency)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        has_k = [k < vocab for k in top_k]
        restricted = [k or p for k, p in zip(has_k, top_p_on)]
        keys = [seed_keys(s) for s in seeds]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        column = dict(dtype=torch.float32, device=device)
        return cls(
            greedy=upload(greedy, torch.bool, device),
            temperature=upload(temps, **column).unsqueeze(1),
            top_k=upload(top_k, torch.int64, device).unsqueeze(1),
            top_p=upload(top_p, **column).unsqueeze(1),
            penalty=upload(penalty, **column).unsqueeze(1),
            presence=upload(presence, **column).unsqueeze(1),
            frequency=upload(frequency, **column).unsqueeze(1),
            log_min_p=upload([math.log(m) if m > 0 else float("-inf") for m in min_p], **column).unsqueeze(1),
            restricted=upload(restricted, torch.bool, device).unsqueeze(1),
            has_top_k=upload(has_k, torch.bool, device).unsqueeze(1),
            key_a=upload([a for a, _ in keys], torch.int64, device),
            key_b=upload([b for _, b in keys], torch.int64, device),
            bias=(biases or BiasCache()).build(params, vocab, device),
            dry=DryRows.build(params, vocab, device, breakers),
            penalised=[p != 1.0 for p in penalty],
            counted=counted,
            logprob_rows=logprob_rows,
            logprob_index=upload(logprob_rows, torch.int64, device) if logprob_rows else None,
            max_logprobs=max((params[i].logprobs for i in logprob_rows), default=0),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_penalty=any(p != 1.0 for p in penalty),
            any_counted=any(counted),
            any_temperature=any(t != 1.0 for t in temps),
            any_filter=any(restricted),
            any_min_p=any(m > 0 for m in min_p),
            any_top_p=any(top_p_on),
            any_top_p_without_top_k=any(p and not k for p, k in zip(top_p_on, has_k)),
            max_top_k=max((k for k in top_k if k < vocab), default=0),
        )

    def select(self, index: torch.Tensor) -> RowParams:
        """These rows only, for the top-k/top-p cut-off; the host-side flags stay those of the whole batch."""
        picked = {f.name: getattr(self, f.name).index_select(0, index) for f in fields(self)
                  if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "logprob_index"}
        return replace(self, **picked)


class BiasCache:
    """Each request's logit_bias as device tensors, made once per request; a batch's Bias is their concatenation.

    The batch's tensors are rebuilt whenever a request joins or leaves it, and a bias can be long: the chat's ban
    on digits after a grounded lead is one entry per digit token, about 1,100 in a vocabulary of 1-3 digit groups.
    Entries are kept for the requests of the last batch only (their params are held, so an id names one object)."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}
        self._where: tuple[int, torch.device] | None = None

    def build(self, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> Bias | None:
        """Ids past the logits' vocab are dropped (the engine refuses them when a request arrives)."""
        if self._where != (vocab, device):
            self._rows, self._where = {}, (vocab, device)
        kept: dict[int, tuple[SamplingParams, torch.Tensor, torch.Tensor]] = {}
        parts, counts = [], []
        for p in params:
            if not p.logit_bias:
                counts.append(0)
                continue
            entry = self._rows.get(id(p)) or kept.get(id(p))
            if entry is None:
                items = [(token, float(value)) for token, value in p.logit_bias.items() if 0 <= token < vocab]
                entry = (p, upload([t for t, _ in items], torch.int64, device),
                         upload([v for _, v in items], torch.float32, device))
            kept[id(p)] = entry
            parts.append(entry)
            counts.append(len(entry[1]))
        self._rows = kept
        total = sum(counts)
        if not total:
            return None
        rows = torch.repeat_interleave(torch.arange(len(params), device=device), upload(counts, torch.int64, device),
                                       output_size=total)
        return Bias(rows, torch.cat([ids for _, ids, _ in parts]), torch.cat([values for _, _, values in parts]))


@dataclass
class Pending:
    """The last step's sampled tokens, still on the device: rows[i] indexes `tokens` for a history whose last id
    is one of them (a placeholder on the host), else None."""

    tokens: torch.Tensor
    rows: Sequence[int | None]


class TokenHistory:
    """Each row's history as a padded [rows, width] id tensor on the device, kept across calls.

    Histories are append-only lists (a sequence's token ids); each call uploads only what was appended since the
    last one, and rows that stay in the batch keep theirs when others join or leave. A row may start further into
    its list (`starts`: the generated tokens only, after the prompt). Padding, and ids beyond the logits' vocab (an
    embedding larger than lm_head: they cannot be generated), point at a spare column.
    """

    def __init__(self) -> None:
        self.histories: list[list[int]] = []
        self.keys: list[int] = []
        self.filled: list[int] = []
        self.ids: torch.Tensor | None = None
        self.vocab = 0

    def update(self, histories: Sequence[list[int]], wanted: Sequence[bool], vocab: int, device: torch.device,
               pending: Pending | None = None, starts: Sequence[int] | None = None) -> torch.Tensor:
        """pending: histories whose last id is still on the device (a placeholder on the host); it is copied
        there from device to device, and uploaded from the host once it is known."""
        keys = [id(h) for h in histories]
        starts = starts if starts is not None else [0] * len(histories)
        old = self.ids if self.ids is not None and self.ids.device == device and self.vocab == vocab else None
        if old is not None and keys == self.keys:
            ids, filled = old, self.filled
        else:
            width = old.shape[1] if old is not None else 64
            ids = torch.full((len(histories), width), vocab, dtype=torch.int64, device=device)
            filled = [0] * len(histories)
            if old is not None:
                # `self.histories` holds the old lists, so an id seen there still names the same list.
                where = {key: i for i, key in enumerate(self.keys)}
                kept_new, kept_old = [], []
                for i, key in enumerate(keys):
                    j = where.get(key)
                    if j is not None and self.filled[j] <= len(histories[i]) - starts[i]:
                        kept_new.append(i)
                        kept_old.append(j)
                        filled[i] = self.filled[j]
                if kept_new:
                    ids[upload(kept_new, torch.int64, device)] = old[upload(kept_old, torch.int64, device)]
        rows: list[int] = []
        cols: list[int] = []
        tokens: list[int] = []
        late: list[list[int]] = [[], [], []]   # rows, columns, indices into pending.tokens
        for i, history in enumerate(histories):
            if not wanted[i]:
                continue
            start = starts[i]
            n = len(history) - start
            if pending is not None and pending.rows[i] is not None:
                n -= 1
                for part, value in zip(late, (i, n, pending.rows[i])):
                    part.append(value)
            if n == filled[i]:
                continue
            if n < filled[i]:   # not append-only after all: rewrite this row
                ids[i] = vocab
                filled[i] = 0
            tokens.extend(history[start + filled[i]:start + n])
            rows.extend([i] * (n - filled[i]))
            cols.extend(range(filled[i], n))
            filled[i] = n
        need = max(cols + late[1], default=-1) + 1
        if need > ids.shape[1]:
            grown = torch.full((ids.shape[0], max(need, 2 * ids.shape[1])), vocab, dtype=torch.int64, device=device)
            grown[:, :ids.shape[1]] = ids
            ids = grown
        if tokens:
            index = upload([rows, cols, tokens], torch.int64, device)
            ids[index[0], index[1]] = index[2].clamp(0, vocab)
        if late[0]:
            index = upload(late, torch.int64, device)
            ids[index[0], index[1]] = pending.tokens[index[2]].clamp(0, vocab)
        self.histories, self.keys, self.filled, self.ids, self.vocab = list(histories), keys, filled, ids, vocab
        return ids


# ---- the processors, as whole-batch tensor ops ---------------------------------------------------------------------

@dataclass
class GrammarMasks:
    """The step's constrained rows and their allowed tokens, one bit per token (llguidance's layout; grammar.py)."""

    rows: torch.Tensor   # int64 [C]: rows of the batch's logits
    bits: torch.Tensor   # int32 [C, words], on the logits' device
    every_row: bool      # C equals the batch: no row selection needed


# Bit j of byte b of a mask row allows token 8 * b + j (llguidance's int32 words, little-endian, read as bytes). A
# mask is applied by adding 0 (allowed: the score unchanged, exactly) or -inf, one lookup of 8 values per byte:
# several times cheaper on a CPU than filling through a boolean mask.
_BYTE_ADDEND = torch.zeros(256, 8).masked_fill_(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0,
                                                float("-inf"))
_ADDEND_ON: dict[torch.device, torch.Tensor] = {}


def mask_addend(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [C, vocab] from int32 bitmasks [C, words]: 0 where allowed, -inf elsewhere (columns past the masks'
    width too)."""
    table = _ADDEND_ON.get(bits.device)
    if table is None:
        table = _ADDEND_ON.setdefault(bits.device, _BYTE_ADDEND.to(bits.device))
    addend = torch.nn.functional.embedding(bits.contiguous().view(torch.uint8).long(), table).view(bits.shape[0], -1)
    if addend.shape[1] >= vocab:
        return addend[:, :vocab]
    return torch.cat([addend, addend.new_full((bits.shape[0], vocab - addend.shape[1]), float("-inf"))], dim=1)


def mask_(scores: torch.Tensor, masks: GrammarMasks) -> None:
    """Disallowed tokens of the constrained rows to -inf, in place; other rows untouched."""
    addend = mask_addend(masks.bits, scores.shape[1])
    if masks.every_row:
        scores.add_(addend)
    else:
        scores.index_add_(0, masks.rows, addend)


def penalise_(padded: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> None:
    """transformers' repetition penalty, in place on [rows, vocab + 1] scores: the seen tokens' negative scores
    times it, the others divided. A token seen twice is gathered twice and gets the same value twice."""
    seen = padded.gather(1, ids)
    padded.scatter_(1, ids, torch.where(seen < 0, seen * penalty, seen / penalty))


def count_penalise_(padded: torch.Tensor, ids: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> None:
    """OpenAI's presence and frequency penalties, in place on [rows, vocab + 1] scores, over the generated ids:
    score -= frequency * count + presence * (count > 0). A token seen twice gets the same presence value written
    twice, then the frequency subtracted once per occurrence (equal terms: the same sum in any order)."""
    seen = padded.gather(1, ids)
    padded.scatter_(1, ids, seen - presence)
    padded.scatter_add_(1, ids, (-frequency).expand(ids.shape))


def processed(logits: torch.Tensor, rows: RowParams, history: TokenHistory,
              histories: Sequence[list[int]], pending: Pending | None = None, generated: TokenHistory | None = None,
              prompt_lens: Sequence[int] | None = None, masks: GrammarMasks | None = None,
              dry_history: TokenHistory | None = None) -> torch.Tensor:
    """float32 scores after the grammar mask, the logit bias, the repetition penalty, the presence and frequency
    penalties and DRY, in that order (a new tensor then, else `logits` itself when float32). prompt_lens: where each
    history's generated tokens start (None: all of it is generated)."""
    if not rows.any_processor and masks is None:
        return logits.float()
    vocab = logits.shape[1]
    padded = torch.empty(logits.shape[0], vocab + 1, dtype=torch.float32, device=logits.device)
    padded[:, :vocab] = logits
    scores = padded[:, :vocab]
    if masks is not None:
        mask_(scores, masks)
    if rows.bias is not None:
        scores.index_put_((rows.bias.rows, rows.bias.ids), rows.bias.values, accumulate=True)
    if rows.any_penalty:
        penalise_(padded, history.update(histories, rows.penalised, vocab, logits.device, pending), rows.penalty)
    if rows.any_counted:
        ids = (generated or TokenHistory()).update(histories, rows.counted, vocab, logits.device, pending,
                                                   prompt_lens)
        count_penalise_(padded, ids, rows.presence, rows.frequency)
    if rows.dry is not None:
        ids = (dry_history or TokenHistory()).update(histories, rows.dry.wanted, vocab, logits.device, pending)
        dry_penalise_(padded, ids, [len(h) for h in histories], rows.dry, prompt_lens)
    return scores


@dataclass
class Cutoff:
    """Each row's lowest kept score after top-k and top-p, and the best `width` tokens it was found among."""

    threshold: torch.Tensor   # [R, 1]; -inf for rows without top-k or top-p
    values: torch.Tensor      # [R, width], descending
    indices: torch.Tensor     # [R, width]
    weights: torch.Tensor     # [R, width]: exp(values - row max)
    unknown: torch.Tensor     # bool [R, 1]: the cut-off may lie beyond `width` (only when width < vocab)

    def head(self, width: int) -> Cutoff:
        """The best `width` tokens of each row only."""
        return replace(self, values=self.values[:, :width], indices=self.indices[:, :width],
                       weights=self.weights[:, :width])


def cutoff(scores: torch.Tensor, row_max: torch.Tensor, rows: RowParams, width: int) -> Cutoff:
    """Top-k then top-p (transformers' order): keep rank r while r < k and the mass above r is below top_p.

    Ties with the lowest kept score are kept, as transformers' top-k does.
    """
    vocab = scores.shape[1]
    if width >= vocab:
        values, indices = scores.sort(dim=-1, descending=True)
    else:
        values, indices = top_k(scores, width)
    weights = (values - row_max).exp_()
    ranks = torch.arange(values.shape[1], device=scores.device)
    keep = ranks < rows.top_k
    if rows.any_top_p:
        mass = weights.cumsum(dim=-1)
        # Normaliser: the mass top-k kept (its last kept rank), or the whole row's without top-k.
        total = mass.gather(1, (rows.top_k.clamp(max=values.shape[1]) - 1))
        if rows.any_top_p_without_top_k:
            row_total = exp_sums(scores, row_max)
            total = torch.where(rows.has_top_k, total, row_total)
        keep &= (mass - weights) < rows.top_p * total
    count = keep.sum(dim=-1, keepdim=True)
    threshold = values.gather(1, count - 1)
    threshold = threshold.masked_fill(~rows.restricted, float("-inf"))
    unknown = rows.restricted & (rows.top_k > width) & (rows.has_top_k | (count == width))
    return Cutoff(threshold, values, indices, weights, unknown)


def _row_kernels(x: torch.Tensor):
    """top_k.c's library where it takes x's rows (2-D float32 on a CPU, each row contiguous), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
        return None
    return native.load_top_k()


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k best scores, best first, and their columns: torch.topk's, in C on a CPU (top_k.c: block maxima,
    a bound by radix counts and a heap, 2.6-2.9x faster than torch.topk over SmolLM2's vocabulary with the
    quickselect it had before), where equal scores keep the lower column first."""
    lib = _row_kernels(scores)
    if lib is None or not 0 < k <= scores.shape[1]:
        return scores.topk(k, dim=-1)
    rows, cols = scores.shape
    values, indices = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    if lib.top_k_f32(scores.data_ptr(), rows, cols, scores.stride(0), k, values.data_ptr(), indices.data_ptr(),
                     torch.get_num_threads()) != 0:
        raise MemoryError(f"top-k: no memory for {k} entries a row")
    return values, indices


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum [R, 1], the same bits whether the row comes alone or with others: a request left alone (the
    last one running, or answered again after a redelivery) draws what it would beside others. On a CPU torch's
    sum splits a lone row between threads, and only a lone one; top_k.c sums each row in one thread, and without it
    a running sum's last entry stands in. A device keeps torch's sum (its matmuls do not promise a row the same
    bits in every batch either)."""
    lib = _row_kernels(x)
    if lib is None:
        return x.cumsum(dim=-1)[:, -1:] if x.device.type == "cpu" else x.sum(dim=-1, keepdim=True)
    out = torch.empty(x.shape[0], 1)
    lib.row_sums_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def exp_sums(scores: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """row_sums((scores - row_max).exp()) [R, 1], in one pass on a CPU (top_k.c: a polynomial exp within 2 ulp of
    expf, no row of exponentials made), with row_sums' promise: a row's bits are the same alone or in any batch."""
    lib = _row_kernels(scores)
    if lib is None:
        return row_sums((scores - row_max).exp_())
    row_max = row_max.to(torch.float32).contiguous()
    out = torch.empty(scores.shape[0], 1)
    lib.exp_sums_f32(scores.data_ptr(), scores.shape[0], scores.shape[1], scores.stride(0), row_max.data_ptr(),
                     out.data_ptr(), torch.get_num_threads())
    return out


def min_p_floor(row_max: torch.Tensor, rows: RowParams) -> torch.Tensor | None:
    """The lowest score min_p keeps: probability >= min_p * the best token's, i.e. score >= best + log(min_p)
    (transformers' MinPLogitsWarper, which comes after top-k and top-p: the kept sets simply intersect)."""
    return row_max + rows.log_min_p if rows.any_min_p else None


_LOWEST = torch.finfo(torch.float32).min   # below it: only -inf


def _raised(threshold: torch.Tensor, floor: torch.Tensor | None) -> torch.Tensor:
    return threshold if floor is None else torch.maximum(threshold, floor)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column where each row's running weight first exceeds u times its total; never a zero-weight column."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).clamp_(max=weights.shape[1] - 1)


def draw_full(scores: torch.Tensor, row_max: torch.Tensor, threshold: torch.Tensor | None,
              u: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Inverse-CDF draw over the whole row in token-id order. masked: some scores are -inf (grammar masks); exp
    takes a slow path on them on a CPU, so they get their zero weight from the threshold instead (the other
    weights are the same bits either way)."""
    shifted = scores - row_max
    if masked:
        shifted.nan_to_num_(neginf=0.0)
        threshold = _raised(torch.full_like(row_max, _LOWEST), threshold)
    weights = shifted.exp_()
    if threshold is not None:
        weights.masked_fill_(scores < threshold, 0.0)
    return _inverse_cdf(weights, u).squeeze(1)


def draw_candidates(cut: Cutoff, threshold: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The same draw as `draw_full` when every kept token is a candidate: candidates put back in token-id order."""
    weights = cut.weights.masked_fill(cut.values < threshold, 0.0)
    ids, order = cut.indices.sort(dim=-1)
    column = _inverse_cdf(weights.gather(1, order), u)
    return ids.gather(1, column).squeeze(1)


def apply_processors(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[list[int]],
                     prompt_lens: Sequence[int] | None = None, masks: GrammarMasks | None = None,
                     breakers: BreakerResolver | None = None) -> torch.Tensor:
    """The grammar mask, logit bias, repetition, presence and frequency penalties, DRY, temperature, top-k, top-p
    and min_p, in the sampler's order, as the sampler applies them.

    Returns a new float32 tensor with filtered tokens at -inf; `logits` is left untouched. Greedy rows only get
    the mask, the bias and the penalties, matching `generate(do_sample=False)`, which skips the warpers.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(histories) != len(params):
        raise ValueError("logits must be [B, V] with one params entry and one history per row")
    vocab = logits.shape[1]
    rows = RowParams.build(params, [0] * len(params), vocab, logits.device, breakers)
    scores = processed(logits, rows, TokenHistory(), histories, None, TokenHistory(), prompt_lens, masks)
    if scores.data_ptr() == logits.data_ptr():
        scores = scores.clone()
    if rows.any_temperature:
        scores = scores / rows.temperature
    if rows.any_filter or rows.any_min_p:
        row_max = scores.amax(dim=-1, keepdim=True)
        threshold = cutoff(scores, row_max, rows, vocab).threshold if rows.any_filter else \
            torch.full_like(row_max, float("-inf"))
        threshold = _raised(threshold, min_p_floor(row_max, rows))
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    return scores


def first_largest(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (its first largest score; a NaN's, where a row has one): top_k.c's one pass on a CPU (16
    rows of 49,152: 59 us against max's 217), else max's indices (on a CPU a third of argmax's time)."""
    lib = _row_kernels(scores)
    if lib is None or scores.shape[1] == 0 or scores.shape[1] >= 2**31:
        return scores.max(dim=-1).indices
    out = torch.empty(scores.shape[0], dtype=torch.int64)
    lib.first_largest_f32(scores.data_ptr(), scores.shape[0], scores.shape[1], scores.stride(0), out.data_ptr(),
                          torch.get_num_threads())
    return out


class Sampler:
    """Picks one token per row. Greedy rows take the exact argmax; sampled rows draw with one uniform from
    (seed, position), so a request's tokens do not depend on which other requests share the batch.

    On CUDA, a batch whose sampled rows have no top-k, top-p or min_p (temperature alone, after any processor)
    draws by `race` instead: one fused pass over the logits, where the inverse-CDF draw takes about eight."""

    def __init__(self, candidates: int | None = None, race: bool | None = None,
                 breakers: BreakerResolver | None = None) -> None:
        self.candidates = candidates   # 0 takes the device path; None: CPU_CANDIDATES on a CPU, 0 elsewhere
        self.race = race               # None: on CUDA
        self.breakers = breakers       # DRY's sequence breakers to token ids (dry.BreakerTokens)
        self.history = TokenHistory()     # whole histories, for the repetition penalty
        self.generated = TokenHistory()   # generated tokens only, for the presence and frequency penalties
        self.dry_history = TokenHistory()   # whole histories of the DRY rows
        self.biases = BiasCache()
        self._rows_key: tuple | None = None
        self._rows_params: list[SamplingParams] = []
        self._rows: RowParams | None = None

    def warm_up(self, vocab: int, device: torch.device) -> None:
        """Compile the fused draw before serving (seconds, the first time): one row and two, the row counts the
        compiler tells apart (it specialises a count of one)."""
        if not (self.race if self.race is not None else device.type == "cuda"):
            return
        for rows in (2, 1):
            logits = torch.zeros(rows, vocab, device=device)
            params = RowParams.build([SamplingParams(temperature=0.5)] * rows, [0] * rows, vocab, device)
            race_compiled(logits, params.temperature, params.greedy, params.key_a, params.key_b,
                          torch.zeros(rows, dtype=torch.int64, device=device))

    def rows_for(self, params: Sequence[SamplingParams], seeds: Sequence[int], vocab: int,
                 device: torch.device) -> RowParams:
        """Per-row tensors, rebuilt only when the batch's requests change (params are held, so ids stay unique)."""
        key = (tuple(map(id, params)), tuple(seeds), vocab, device)
        if key != self._rows_key or self._rows is None:
            self._rows = RowParams.build(params, seeds, vocab, device, self.breakers, self.biases)
            self._rows_key, self._rows_params = key, list(params)
        return self._rows

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 histories: Sequence[list[int]], seeds: Sequence[int], pending: Pending | None = None,
                 prompt_lens: Sequence[int] | None = None, masks: GrammarMasks | None = None) -> torch.Tensor:
        """pending: histories whose last token is not read back yet (overlapped steps); a history's length is
        its position whether or not its last id is known. prompt_lens: where each history's generated tokens
        start (None: all of it counts as generated). masks: the constrained rows' allowed tokens."""
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(histories) == len(seeds):
            raise ValueError("logits must be [B, V] with one params entry, history and seed per row")
        vocab, device = logits.shape[1], logits.device
        rows = self.rows_for(params, seeds, vocab, device)
        if rows.all_greedy and not rows.any_processor and masks is None:
            return first_largest(logits)   # plain greedy decoding: nothing to process

        positions = upload([len(h) for h in histories], torch.int64, device)
        if (self.race if self.race is not None else device.type == "cuda") and not rows.any_filter \
                and not rows.any_min_p:
            scores = logits if not rows.any_processor and masks is None else \
                processed(logits, rows, self.history, histories, pending, self.generated, prompt_lens, masks,
                          self.dry_history)
            draw = race_compiled if device.type == "cuda" else race
            return draw(scores, rows.temperature, rows.greedy, rows.key_a, rows.key_b, positions)
        scores = processed(logits, rows, self.history, histories, pending, self.generated, prompt_lens, masks,
                           self.dry_history)
        greedy_tokens = first_largest(scores) if rows.any_greedy else None
        if rows.all_greedy:
            return greedy_tokens
        if rows.any_temperature:
            scores = scores / rows.temperature
        u = uniforms(rows.key_a, rows.key_b, positions)
        tokens = self._draw(scores, rows, u, masks is not None)
        return tokens if greedy_tokens is None else torch.where(rows.greedy, greedy_tokens, tokens)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams],
                 seeds: Sequence[int]) -> torch.Tensor | None:
        """For the rows whose requests asked (RowParams.logprob_rows, in order): each sampled token's
        log-probability, rank and the most likely tokens under the raw logits, packed (logprobs.pack); None when
        no row asked."""
        rows = self.rows_for(params, seeds, logits.shape[1], logits.device)
        if rows.logprob_index is None:
            return None
        index = rows.logprob_index
        if len(rows.logprob_rows) == logits.shape[0]:
            return pack_logprobs(logits, tokens, rows.max_logprobs)
        return pack_logprobs(logits.index_select(0, index), tokens.index_select(0, index), rows.max_logprobs)

    def _draw(self, scores: torch.Tensor, rows: RowParams, u: torch.Tensor, masked: bool) -> torch.Tensor:
        vocab = scores.shape[1]
        row_max = scores.amax(dim=-1, keepdim=True)
        floor = min_p_floor(row_max, rows)
        if not rows.any_filter:
            return draw_full(scores, row_max, floor, u, masked)
        limit = self.candidate_limit(scores.device)
        if limit:
            return self._draw_among_candidates(scores, row_max, floor, rows, u, limit, masked)
        # A top-k cut-off lies among the best max(k) + 1 tokens (no sort); a top-p row without top-k sorts its row.
        width = vocab if rows.any_top_p_without_top_k else min(vocab, rows.max_top_k + 1)
        return draw_full(scores, row_max, _raised(cutoff(scores, row_max, rows, width).threshold, floor), u, masked)

    def candidate_limit(self, device: torch.device) -> int:
        """How many best tokens a top-k/top-p cut-off is looked for among first (0: the device path)."""
        if self.candidates is not None:
            return self.candidates
        return CPU_CANDIDATES if device.type == "cpu" else 0

    def _draw_among_candidates(self, scores: torch.Tensor, row_max: torch.Tensor, floor: torch.Tensor | None,
                               rows: RowParams, u: torch.Tensor, limit: int, masked: bool) -> torch.Tensor:
        """The cut-off among the best tokens (one more than the largest k, so a binding top-k shows), with the rows
        whose cut-off or kept tokens lie further down redone over the whole row. The host reads here cost nothing
        on a CPU, where there is no queue of device work to wait for; on a device each waits for the step so far."""
        vocab = scores.shape[1]
        want = rows.max_top_k + 1 if not rows.any_top_p_without_top_k else max(limit, rows.max_top_k + 1)
        width = min(vocab, want, MAX_CANDIDATES)
        cut = cutoff(scores, row_max, rows, width)
        if width >= vocab:
            return draw_full(scores, row_max, _raised(cut.threshold, floor), u, masked)
        threshold = cut.threshold
        unknown = cut.unknown.squeeze(1).nonzero().squeeze(1)
        if len(unknown):   # those rows' cut-off lies beyond the candidates: a full sort of just them
            full = cutoff(scores.index_select(0, unknown), row_max.index_select(0, unknown), rows.select(unknown),
                          vocab)
            threshold = threshold.index_copy(0, unknown, full.threshold)
        threshold = _raised(threshold, floor)
        # Tokens below every row's cut-off weigh nothing in the draw: it takes the widest row's kept tokens only.
        kept = int((cut.values >= threshold).sum(dim=1).max())
        tokens = draw_candidates(cut.head(kept) if 0 < kept < width else cut, threshold, u)
        # Every kept token is a candidate when the best token left out scores below the cut-off (a token tied
        # with the cut-off is kept). Greedy rows take their argmax afterwards.
        beyond = ~(rows.greedy | (cut.values[:, -1] < threshold.squeeze(1)))
        redo = beyond.nonzero().squeeze(1)
        if len(redo):
            drawn = draw_full(scores.index_select(0, redo), row_max.index_select(0, redo),
                              threshold.index_select(0, redo), u.index_select(0, redo), masked)
            tokens = tokens.index_copy(0, redo, drawn)
        return tokens
