"""The engine: submit requests, step the batch, stream events; thread-safe around one loop thread."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from . import logprobs
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .dry import BreakerTokens
from .grammar import Grammars
from .model_runner import ModelRunner, _text_config
from .outputs import EngineStats, Event, RequestFinished, TokenDelta, TokenLogprob
from .sampler import Pending, Sampler, choice_seed, random_seed
from .sampling_params import SamplingParams
from .scheduler import Batch, Scheduler
from .sequence import PENDING, SERVICE_CLASSES, Sequence, Status
from .transfer import Readback, upload

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A step's sampled tokens not yet read back: row i is the next token of seqs[i]; with the log-probabilities
    of those whose requests asked, packed (logprobs.pack), in the same order."""

    seqs: list[Sequence]
    readback: Readback
    logprobs: Readback | None = None


@dataclass
class StepRows:
    """Where a step's logits rows go, in the order ModelRunner.run keeps them."""

    sampling: list[Sequence]   # sequences whose next token comes from this step's logits
    rows: list[int]            # the row of each
    # prefills done this step whose answers have every token they may (Engine._complete): they draw nothing
    complete: list[Sequence]
    # scored prefill rows (Sequence.scored_from): (sequence, first position, first row, rows)
    prompts: list[tuple[Sequence, int, int, int]]


@dataclass
class PromptScores:
    """Log-probabilities of the prompt tokens and continued answer tokens a step's prefill rows score, packed on
    the device until `_record_prompts` reads them."""

    spans: list[tuple[Sequence, int, int]]   # (sequence, first position scored, positions)
    top: int
    packed: torch.Tensor


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message says what to change."""


class RequestStream:
    """Events of one request, in order; iterating ends after the final RequestFinished.

    A stream submitted with an `outbox` is not iterated: its events go to that queue instead, in lists that hold
    every request's events known at one point of a step (one or a few lists per step), so a single consumer
    can forward a step's output at once.
    """

    def __init__(self, engine: LLMEngine, request_id: str, outbox: queue.Queue[list[Event]] | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.events: queue.Queue[Event] = queue.Queue()
        self.outbox = outbox

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.events.get()
            yield event
            if event.finished:
                return

    def batches(self) -> Iterator[list[Event]]:
        """Events in order, grouped: everything that arrived while the caller was busy comes at once.

        A consumer that forwards each event over a network does one send per group instead of falling
        further behind the engine one token at a time.
        """
        while True:
            batch = [self.events.get()]
            while not batch[-1].finished and not self.events.empty():
                batch.append(self.events.get_nowait())
            yield batch
            if batch[-1].finished:
                return

    def cancel(self) -> None:
        self.engine.abort(self.request_id)


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.config.validate()
        self.tokenizer = tokenizer
        self.vocab = self._logits_width(model)
        self.runner = ModelRunner(model, self.config)
        self.device = self.runner.device
        self.max_model_len = self.runner.max_len
        self.blocks = BlockManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.sampler = Sampler(self.config.sampler_candidates, breakers=BreakerTokens(tokenizer))
        self.sampler.warm_up(self.vocab, self.device)
        self.eos_ids = self._eos_ids(model, tokenizer)
        self.grammars = Grammars(tokenizer, self.eos_ids, self.vocab)
        self.seqs: dict[str, Sequence] = {}   # request id -> its first choice (`group` holds them all)
        self.steps = 0
        self.num_continued = 0   # requests that went on from an earlier delivery's tokens
        self.last_batch = (0, 0)
        self._in_flight: InFlight | None = None   # overlapped steps: the last step's tokens, still on the device
        # Threaded mode: other threads only touch these, under the lock; the loop thread drains them.
        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    @staticmethod
    def _logits_width(model) -> int:
        """Columns of the model's logits: its lm_head may be wider than the tokenizer's vocabulary."""
        weight = getattr(model.get_output_embeddings(), "weight", None)
        return int(weight.shape[0]) if weight is not None else int(_text_config(model).vocab_size)

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        ids: set[int] = set()
        gen = getattr(model, "generation_config", None)
        for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return ids

    # ---- building requests -------------------------------------------------------------------

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages -> prompt token ids through the tokenizer's chat template."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content} objects.")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))

    def make_sequence(self, request_id: str, prompt_token_ids: list[int] | None = None,
                      messages: list[dict] | None = None, params: SamplingParams | None = None,
                      arrival_time: float | None = None, service_class: str = "standard",
                      continued: list[list[int]] | None = None) -> Sequence:
        """Validate a request and build its state; raises InvalidRequestError or InvalidParamsError.

        Returns the first choice; `group` holds all n. A structure is compiled here, in the caller's thread (once
        per distinct structure: later requests copy the compiled matcher). service_class: one of
        SERVICE_CLASSES, which the scheduler serves in order (scheduler.py). `continued`: the first tokens of
        each choice's answer, written before (by a worker that stopped mid-answer; none for a choice left out or
        empty); see _continue."""
        params = params or SamplingParams()
        params.validate()
        if service_class not in SERVICE_CLASSES:
            raise InvalidRequestError(f"Unknown service class {service_class!r}; choose one of "
                                      f"{', '.join(SERVICE_CLASSES)}.")
        if (prompt_token_ids is None) == (messages is None):
            raise InvalidRequestError("Give exactly one of prompt_token_ids or messages.")
        ids = self.render_chat(messages) if messages is not None else list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("The prompt is empty; send at least one token or message.")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"The prompt is {len(ids)} tokens but the model's context holds {self.max_model_len} "
                "(prompt and answer together). Shorten the message or start a new conversation.")
        pool_tokens = self.blocks.num_blocks * self.config.block_size
        if len(ids) >= pool_tokens:
            raise InvalidRequestError(
                f"The prompt is {len(ids)} tokens but the KV cache holds only {pool_tokens}. "
                "Shorten the prompt or give the engine a larger KV cache.")
        wanted = max(params.logprobs or 0, params.prompt_logprobs or 0)
        if wanted > self.vocab:
            raise InvalidRequestError(f"{wanted} alternatives per token asked for, but the model has only "
                                      f"{self.vocab} tokens.")
        outside = sorted(t for t in (params.logit_bias or {}) if t >= self.vocab)
        if outside:
            raise InvalidRequestError(f"logit_bias names token ids the model does not have: {outside[:5]}; "
                                      f"its ids run from 0 to {self.vocab - 1}.")
        outside = sorted(t for t in params.stop_token_ids if t >= self.vocab)
        if outside:
            raise InvalidRequestError(f"stop_token_ids names token ids the model does not have: {outside[:5]}; "
                                      f"its ids run from 0 to {self.vocab - 1}.")
        if params.dry and params.dry_sequence_breakers:   # their token ids, looked up here rather than in a step
            self.sampler.breakers(tuple(params.dry_sequence_breakers))
        seed = params.seed if params.seed is not None else random_seed()
        arrival_time = arrival_time or time.time()
        # Until min_tokens, EOS and the stop tokens are masked out of the draw (a bias of -inf) and stop strings are
        # not looked for.
        end_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids))
        early = replace(params, logit_bias={**(params.logit_bias or {}), **dict.fromkeys(end_ids, -math.inf)}) \
            if params.min_tokens > 0 and end_ids else None
        group = [Sequence(
            request_id=request_id, prompt_token_ids=ids, params=params, arrival_time=arrival_time,
            seed=choice_seed(seed, index),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                               params.include_stop_str_in_output),
            index=index, matcher=self.grammars.matcher(params.structure) if params.structure is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else [], service_class=service_class,
            early_params=early)
            for index in range(params.n)]
        for seq in group:
            seq.group = group
            seq.detokenizer.armed = params.min_tokens == 0 and seq.matcher is None
        if continued:
            if len(continued) > params.n:
                raise InvalidRequestError(f"{len(continued)} answers to continue, but the request has {params.n} "
                                          "choices (n).")
            for seq, tokens in zip(group, continued):
                if tokens:
                    self._continue(seq, list(tokens))
        return group[0]

    def _continue(self, seq: Sequence, tokens: list[int]) -> None:
        """Start the answer with `tokens`: they count as generated (for max_new_tokens, min_tokens, penalties,
        DRY, stop strings, the grammar and usage), are computed with the prompt, and their text goes out with
        the first new token's delta, so the deltas still add up to the answer's whole text. Their
        log-probabilities, where the request asks for them, are scored from the prefill's rows as a prompt's are
        (the delta sends only the new token's: a client already has theirs; the answer's end has all)."""
        params = seq.params
        if len(tokens) > params.max_new_tokens:   # at it, the answer ends once they are computed
            raise InvalidRequestError(f"The answer to continue has {len(tokens)} tokens, more than max_new_tokens "
                                      f"({params.max_new_tokens}).")
        total = seq.num_prompt_tokens + len(tokens)
        if total > self.max_model_len or total >= self.blocks.num_blocks * self.config.block_size:
            raise InvalidRequestError(f"The prompt and the answer to continue are {total} tokens, more than the "
                                      "model's context (or the KV cache) holds.")
        outside = sorted(t for t in tokens if not 0 <= t < self.vocab)
        if outside:
            raise InvalidRequestError(f"The answer to continue names token ids the model does not have: "
                                      f"{outside[:5]}.")
        if seq.matcher is not None and not seq.matcher.consume_tokens(tokens):
            raise InvalidRequestError(f"The answer to continue does not fit its structure: "
                                      f"{seq.matcher.get_error()}")
        seq.token_ids.extend(tokens)
        seq.continued = len(tokens)
        detokenizer, armed = seq.detokenizer, seq.detokenizer.armed
        detokenizer.armed = False   # text written before is not searched for stop strings again
        seq.replay = detokenizer.push(tokens)
        detokenizer.armed = armed

    # ---- synchronous API: the caller drives step() -------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int] | None = None,
                    messages: list[dict] | None = None, params: SamplingParams | None = None,
                    arrival_time: float | None = None, service_class: str = "standard",
                    continued: list[list[int]] | None = None) -> Sequence:
        seq = self.make_sequence(request_id, prompt_token_ids, messages, params, arrival_time, service_class,
                                 continued)
        self._enqueue(seq)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise InvalidRequestError(f"Request id {seq.request_id!r} is already in use; use a new id.")
        self.seqs[seq.request_id] = seq
        self.num_continued += any(choice.continued for choice in seq.group)
        for choice in seq.group:
            self.scheduler.add(choice)

    def abort_request(self, request_id: str) -> list[Event]:
        """Cancel every choice of the request."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return []
        return [event for choice in seq.group for event in self._finish(choice, "cancelled")]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def step(self) -> list[Event]:
        """One iteration: schedule, run one packed forward pass, sample, emit events."""
        events: list[Event] = []
        self._step(events.extend)
        return events

    def _step(self, emit: Callable[[list[Event]], None]) -> None:
        """One iteration; events go to `emit` as soon as they are known, in order.

        With overlapped steps (EngineConfig.overlap_steps) this step's sampled tokens stay on the device: the
        next step is scheduled as if every sequence went on, its forward pass reads them from there, and they
        are read back, streamed and checked for a finish while that pass runs. A sequence found finished then
        loses its row of that pass. The pass's tokens are drawn before the last step's are read back, so the
        device has the draw queued behind the pass, and the host's reading, scheduling and building of the
        next step all happen while it works.

        A step with a grammar-constrained row is drawn after the read-back instead: the row's mask needs its last
        token consumed by its matcher on the host. The forward passes still overlap the read-backs.
        """
        batch, impossible = self.scheduler.schedule()
        events: list[Event] = []
        for seq in impossible:
            events += self._finish(seq, "length")
        if not batch:
            emit(events + self._land())
            return
        self.steps += 1
        self.last_batch = (batch.num_seqs, batch.num_tokens)
        flight = self._in_flight
        try:
            logits = self.runner.run(batch, flight.readback.tokens if flight else None)
        except Exception:
            log.exception("forward pass failed; running its requests one at a time")
            emit(events + self._land())
            emit(self._run_one_by_one(batch))
            return
        step = self._computed(batch)
        scores = self._score_prompts(step, logits)
        sampling, logits = self._sampling(step, logits)
        ahead = self.config.overlap_steps and not any(seq.matcher is not None for seq in sampling)
        drawn = self._draw_ahead(sampling, logits) if ahead else None
        emit(events + self._land())   # the last step's tokens, read while this pass runs on the device
        self._register(batch)
        emit(self._record_prompts(step, scores))
        if drawn is not None:
            self._take_off(sampling, drawn)
            return
        if any(seq.finished for seq in sampling):
            rows = [i for i, seq in enumerate(sampling) if not seq.finished]
            sampling = [sampling[i] for i in rows]
            logits = logits[upload(rows, torch.long, logits.device)]
        if sampling:
            emit(self._sample(sampling, logits, defer=self.config.overlap_steps))

    def _sampling(self, step: StepRows, logits) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences that draw a token from this step, and their logits rows."""
        if len(step.rows) == logits.shape[0]:   # rows ascend: all of them, in order
            return step.sampling, logits
        return step.sampling, logits[upload(step.rows, torch.long, logits.device)]

    def _score_prompts(self, step: StepRows, logits) -> PromptScores | None:
        """Queue the log-probabilities of the tokens this step's kept prefill rows score: row j of a chunk holds
        position first + j, whose logits score the token after it: a prompt token (prompt_logprobs), or one of a
        continued answer's tokens (logprobs: those an earlier delivery wrote, as if drawn here)."""
        rows, targets, spans, top = [], [], [], 0
        for seq, first, row, n in step.prompts:
            params, last_prompt = seq.params, seq.num_prompt_tokens - 1
            start = first if params.prompt_logprobs is not None else max(first, last_prompt)
            end = min(first + n, last_prompt + (seq.continued if params.logprobs is not None else 0))
            if end <= start:
                continue
            rows.extend(range(row + start - first, row + end - first))
            targets.extend(seq.token_ids[start + 1:end + 1])
            spans.append((seq, start + 1, end - start))
            top = max(top, params.prompt_logprobs or 0 if start < last_prompt else 0,
                      params.logprobs or 0 if end > last_prompt else 0)
        if not rows:
            return None
        device = logits.device
        packed = logprobs.pack(logits[upload(rows, torch.long, device)], upload(targets, torch.long, device), top)
        return PromptScores(spans, top, packed)

    def _record_prompts(self, step: StepRows, scores: PromptScores | None) -> list[Event]:
        """Keep the step's prompt and continued tokens' log-probabilities (a chunk computed again after a
        preemption adds nothing), and end those that draw nothing (`_sampling`)."""
        if scores is not None:
            values, k = scores.packed.tolist(), 0
            for seq, first, count in scores.spans:
                prompt = seq.num_prompt_tokens
                for position in range(first, first + count):
                    if position < prompt and position == len(seq.prompt_logprobs):
                        seq.prompt_logprobs.append(logprobs.unpack(
                            seq.token_ids[position], values[k], seq.params.prompt_logprobs, scores.top))
                    elif position >= prompt and position - prompt == len(seq.logprobs):
                        seq.logprobs.append(logprobs.unpack(
                            seq.token_ids[position], values[k], seq.params.logprobs, scores.top))
                    k += 1
        events: list[Event] = []
        for seq in step.complete:
            events += self._finish(seq, "length")
        return events

    def _complete(self, seq: Sequence) -> bool:
        """The answer has every token it may, so it draws nothing: a request that only scores its prompt
        (max_new_tokens 0), or an answer continued from all its tokens (to max_new_tokens or the model's
        context)."""
        return seq.num_completion_tokens >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len

    def _draw_ahead(self, sampling: list[Sequence], logits) -> tuple[Readback, Readback | None] | None:
        """The step's tokens, drawn before the last step's are read back: a pending token holds its place in
        its sequence and, for a repetition penalty, is read on the device. None: a failure, sampled again
        after reading back, where it is isolated to its request."""
        if not sampling:
            return None
        flight = self._in_flight
        pending = Pending(flight.readback.tokens, [s.pending for s in sampling]) if flight else None
        try:
            tokens, packed = self._draw(sampling, logits, pending)
        except Exception:
            log.exception("drawing the step's tokens ahead failed; drawing them after reading back")
            return None
        return Readback(tokens), Readback(packed) if packed is not None else None

    def _draw(self, sampling: list[Sequence], logits,
              pending: Pending | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampler over the sequences' rows: their tokens as a device tensor, and the packed log-probabilities
        of those whose requests asked (None when none did). Constrained rows get their grammar's masks, which
        need every row's last token known."""
        params, seeds = [s.draw_params for s in sampling], [s.seed for s in sampling]
        masks = None
        if any(s.matcher is not None for s in sampling):
            masks = self.grammars.masks([s.matcher for s in sampling], logits.device)
        tokens = self.sampler(logits, params, [s.token_ids for s in sampling], seeds, pending,
                              prompt_lens=[s.num_prompt_tokens for s in sampling], masks=masks)
        return tokens, self.sampler.logprobs(logits, tokens, params, seeds)

    def _take_off(self, sampling: list[Sequence], drawn: tuple[Readback, Readback | None]) -> None:
        """Leave the step's tokens in flight: each sequence that goes on gets a placeholder for its token."""
        self._in_flight = InFlight(sampling, *drawn)
        for row, seq in enumerate(sampling):
            if not seq.finished:   # finished while its row ran: that token is dropped
                seq.token_ids.append(PENDING)
                seq.pending = row

    def _land(self) -> list[Event]:
        """Read back the tokens of the step in flight, if any, and append them: stream, stop, finish."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        tokens = flight.readback.tolist()
        found = self._token_logprobs(flight.seqs, tokens, flight.logprobs.tolist() if flight.logprobs else None)
        seqs, landed, entries = [], [], []
        for i, (seq, token) in enumerate(zip(flight.seqs, tokens)):
            if seq.pending is None:   # finished meanwhile (cancelled, say): the token is dropped
                continue
            seq.token_ids.pop()
            seq.pending = None
            seqs.append(seq)
            landed.append(token)
            entries.append(found[i] if found else None)
        return self._append_tokens(seqs, landed, entries if found else None)

    @staticmethod
    def _token_logprobs(seqs: list[Sequence], tokens: list[int],
                        packed: list[list[float]] | None) -> list[TokenLogprob | None] | None:
        """Packed rows (one per sequence that asked, in order) as one entry per sequence."""
        if packed is None:
            return None
        width = (len(packed[0]) - 2) // 2
        rows = iter(packed)
        return [logprobs.unpack(token, next(rows), seq.params.logprobs, width) if seq.params.logprobs is not None
                else None for seq, token in zip(seqs, tokens)]

    def _run_one_by_one(self, batch: Batch) -> list[Event]:
        """Find the request that breaks a forward pass: it fails, every other request goes on.

        Nothing advanced in the failed pass, so rerunning a sequence rewrites the same KV slots.
        """
        events: list[Event] = []
        parts = ([Batch(decodes=[seq]) for seq in batch.decodes if not seq.finished]
                 + [Batch(prefills=[p]) for p in batch.prefills if not p[0].finished])
        for part in parts:
            try:
                logits = self.runner.run(part)
            except Exception as exc:
                events += self._fail(part.decodes[0] if part.decodes else part.prefills[0][0], exc)
                continue
            events += self._advance(part, logits)
        return events

    def _advance(self, batch: Batch, logits) -> list[Event]:
        step = self._computed(batch)
        scores = self._score_prompts(step, logits)
        sampling, logits = self._sampling(step, logits)
        self._register(batch)
        events = self._record_prompts(step, scores)
        return events + (self._sample(sampling, logits, defer=False) if sampling else [])

    def _computed(self, batch: Batch) -> StepRows:
        """Count the tokens the step's pass computed; say which logits rows sample and which score prompts."""
        sampling, rows, prompts, complete = list(batch.decodes), list(range(len(batch.decodes))), [], []
        row = len(batch.decodes)
        for seq, n in batch.prefills:
            first, scored = seq.num_computed_tokens, seq.scored_from   # as the runner saw them
            seq.num_computed_tokens += n
            seq.prefilled = seq.prefilled or seq.num_computed_tokens >= seq.num_prompt_tokens
            done = seq.num_computed_tokens == seq.num_tokens
            kept = first + n - max(first, scored) if scored is not None and first + n > scored else 0
            if kept:
                prompts.append((seq, first + n - kept, row, kept))
            row += kept or int(done)
            if done and self._complete(seq):
                complete.append(seq)
            elif done:
                sampling.append(seq)
                rows.append(row - 1)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq in batch.decodes + [s for s, _ in batch.prefills]:
            seq.batch_size_sum += batch.num_seqs
            seq.steps += 1
        return StepRows(sampling, rows, complete, prompts)

    def _register(self, batch: Batch) -> None:
        """Offer the blocks the step filled to the prefix cache (their token ids must all be known by now).

        A decode fills a block only every block_size tokens: the others are skipped without a call."""
        bs = self.config.block_size
        for seq in batch.decodes:
            if seq.num_computed_tokens % bs == 0 and not seq.finished:
                self.blocks.register_full_blocks(seq)
        for seq, _ in batch.prefills:
            if not seq.finished:
                self.blocks.register_full_blocks(seq)

    def _sample(self, sampling: list[Sequence], logits, defer: bool) -> list[Event]:
        """Pick each sequence's next token; `defer` leaves the tokens on the device, in flight, for now."""
        try:
            tokens, packed = self._draw(sampling, logits)
        except Exception:
            log.exception("sampling failed; sampling each request alone")
            return self._sample_one_by_one(sampling, logits)
        if not defer:
            ids = tokens.tolist()
            return self._append_tokens(sampling, ids, self._token_logprobs(
                sampling, ids, packed.tolist() if packed is not None else None))
        self._take_off(sampling, (Readback(tokens), Readback(packed) if packed is not None else None))
        return []

    def _sample_one_by_one(self, sampling: list[Sequence], logits) -> list[Event]:
        events = []
        for seq, row in zip(sampling, logits):
            try:
                tokens, packed = self._draw([seq], row[None])
                ids = tokens.tolist()
                entries = self._token_logprobs([seq], ids, packed.tolist() if packed is not None else None)
            except Exception as exc:
                events += self._fail(seq, exc)
                continue
            events += self._append_tokens([seq], ids, entries)
        return events

    def _append_tokens(self, seqs: list[Sequence], tokens: list[int],
                       entries: list[TokenLogprob | None] | None = None) -> list[Event]:
        now, events = time.time(), []
        eos_ids, max_len = self.eos_ids, self.max_model_len
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            entry = entries[i] if entries else None
            detokenizer = seq.detokenizer
            try:
                if entry is not None or seq.matcher is not None or seq.first_token_time is None \
                        or not detokenizer.armed:
                    events += self._append_token(seq, token, now, entry)
                    continue
                # Every row of every decode step comes here: _append_token's common case, written out.
                ids = seq.token_ids
                ids.append(token)
                events.append(TokenDelta(seq.request_id, detokenizer.push_token(token), [token], index=seq.index))
                params = seq.params
                if detokenizer.stopped or (token in eos_ids and not params.ignore_eos) or \
                        token in params.stop_token_ids:
                    events += self._finish(seq, "stop")
                elif len(ids) - len(seq.prompt_token_ids) >= params.max_new_tokens or len(ids) >= max_len:
                    events += self._finish(seq, "length")
            except Exception as exc:   # e.g. a stop-string or detokenizer failure: this request only
                events += self._fail(seq, exc)
        return events

    def _fail(self, seq: Sequence, exc: Exception) -> list[Event]:
        log.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc)
        return self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def _append_token(self, seq: Sequence, token: int, now: float, entry: TokenLogprob | None = None) -> list[Event]:
        seq.token_ids.append(token)
        if entry is not None:
            seq.logprobs.append(entry)
        prompt, admitted, continued = None, None, 0
        if seq.first_token_time is None:
            seq.first_token_time, admitted, continued = now, seq.admitted_time, seq.continued
            if seq.index == 0:
                prompt = seq.prompt_logprobs_result()
        if not seq.detokenizer.armed and seq.num_completion_tokens >= seq.params.min_tokens and \
                (seq.matcher is None or seq.matcher.is_stopped()):
            # Stop strings count from here on (not in the text shown before): once the answer has min_tokens and
            # its grammar is complete, so a stop string cannot cut a structured value short.
            seq.detokenizer.armed = True
        text = seq.detokenizer.push_token(token)
        if seq.replay:
            text, seq.replay = seq.replay + text, ""
        events: list[Event] = [TokenDelta(seq.request_id, text, [token], index=seq.index,
                                          logprobs=[entry] if entry is not None else None, prompt_logprobs=prompt,
                                          admitted_time=admitted, continued=continued)]
        if seq.detokenizer.stopped:
            return events + self._finish(seq, "stop")
        if (token in self.eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            return events + self._finish(seq, "stop")
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                raise RuntimeError(f"token {token} does not fit the answer's structure: {seq.matcher.get_error()}")
            if seq.matcher.is_stopped():   # the value is complete: nothing but EOS could follow
                return events + self._finish(seq, "stop")
        if seq.num_completion_tokens >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return events + self._finish(seq, "length")
        return events

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> list[Event]:
        if seq.finished:
            return []
        if seq.pending is not None:   # its last token was never read back: it is not part of the answer
            seq.token_ids.pop()
            seq.pending = None
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error
        seq.finished_time = time.time()
        last = all(choice.finished for choice in seq.group)
        if last and self.seqs.get(seq.request_id) is seq.leader:
            del self.seqs[seq.request_id]
        events: list[Event] = []
        tail = seq.detokenizer.flush()
        if seq.replay:   # ended before a new token: the continued text still goes out
            tail, seq.replay = seq.replay + tail, ""
        if tail:
            events.append(TokenDelta(seq.request_id, tail, [], index=seq.index))
        events.append(RequestFinished(
            request_id=seq.request_id, text=seq.detokenizer.text, token_ids=seq.completion_token_ids,
            finish_reason=reason, prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens, cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time, admitted_time=seq.admitted_time,
            first_token_time=seq.first_token_time, finished_time=seq.finished_time,
            mean_batch_size=seq.batch_size_sum / seq.steps if seq.steps else 0.0,
            preemptions=seq.num_preemptions, error=error, finished=last, index=seq.index,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs_result(), prompt_token_ids=list(seq.prompt_token_ids),
            stop_reason=self._stop_reason(seq) if reason == "stop" else None, continued_tokens=seq.continued))
        return events

    def _stop_reason(self, seq: Sequence) -> str | int | None:
        """The stop string or stop token that ended the answer; None for EOS or a completed grammar."""
        if seq.detokenizer.matched is not None:
            return seq.detokenizer.matched
        last = seq.token_ids[-1] if seq.num_completion_tokens else None
        if last in seq.params.stop_token_ids and (seq.params.ignore_eos or last not in self.eos_ids):
            return last
        return None

    def release_model(self) -> None:
        """Stop and hand the model back unchanged, e.g. to run plain `generate` on it again."""
        self.shutdown()
        self.runner.release_model()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting) + len(self._inbox),
            kv_blocks_used=self.blocks.num_used, kv_blocks_free=self.blocks.num_free,
            kv_blocks_total=self.blocks.num_blocks, steps=self.steps,
            preemptions=self.scheduler.num_preemptions, class_preemptions=self.scheduler.num_class_preemptions,
            continued=self.num_continued,
            prefix_cache_hit_tokens=self.blocks.prefix_hit_tokens,
            prefix_cache_query_tokens=self.blocks.prefix_query_tokens,
            last_batch_seqs=self.last_batch[0], last_batch_tokens=self.last_batch[1])

    # ---- threaded API: a background loop steps; any thread submits and aborts -----------------

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    @classmethod
    def launch(cls, build: Callable[[], LLMEngine]) -> LLMEngine:
        """Build an engine (load the model too) in the thread that will then run its loop, and return it running.

        On CPU, OpenMP keeps a pool of worker threads for every thread that runs parallel ops. An engine built
        in one thread and stepped in another leaves two pools; once they outnumber the cores, libgomp stops
        spin-waiting and every op pays for waking its workers: forward passes were about 25% slower on two
        cores. With one thread doing all the torch work there is one pool.
        """
        handover: queue.Queue[LLMEngine | BaseException] = queue.Queue()

        def run() -> None:
            try:
                engine = build()
                engine._stopping, engine._thread = False, threading.current_thread()
            except BaseException as exc:   # raised again in the caller's thread
                handover.put(exc)
                return
            handover.put(engine)
            engine._loop()

        threading.Thread(target=run, name="engine-loop", daemon=True).start()
        result = handover.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def submit(self, request_id: str, prompt_token_ids: list[int] | None = None,
               messages: list[dict] | None = None, params: SamplingParams | None = None,
               arrival_time: float | None = None, outbox: queue.Queue[list[Event]] | None = None,
               service_class: str = "standard", continued: list[list[int]] | None = None) -> RequestStream:
        """Queue a request from any thread; bad requests raise here, in the caller's thread."""
        seq = self.make_sequence(request_id, prompt_token_ids, messages, params, arrival_time, service_class,
                                 continued)
        stream = RequestStream(self, request_id, outbox)
        with self._lock:
            if self._stopping or self._thread is None:
                raise RuntimeError("The engine is not running; call start() first.")
            if request_id in self._streams:
                raise InvalidRequestError(f"Request id {request_id!r} is already in use; use a new id.")
            self._streams[request_id] = stream
            self._inbox.append(seq)
            self._lock.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self.has_unfinished()):
                    self._lock.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            events: list[Event] = []
            for seq in inbox:
                self._enqueue(seq)
            for request_id in aborts:
                events += self.abort_request(request_id)
            self._dispatch(events)
            try:
                self._step(self._dispatch)
            except Exception as exc:   # a fault outside any one request's (say the device's): none may hang
                log.exception("engine step failed; ending every request it held")
                self._dispatch(self._fail_all(f"The engine failed ({type(exc).__name__}: {exc}); retry."))
        # Nobody waits forever on a stopped engine: fail what is queued, running or not yet drained.
        with self._lock:
            pending, self._inbox = self._inbox, []
        self._dispatch(self._fail_all("The engine shut down before the answer finished; retry.", pending))

    def _fail_all(self, error: str, more: list[Sequence] = ()) -> list[Event]:
        """End every request the engine holds (and `more`) with an error; the tokens in flight are dropped."""
        self._in_flight = None
        events: list[Event] = []
        for seq in list(self.seqs.values()) + list(more):
            for choice in seq.group:
                events += self._finish(choice, "error", error=error)
        return events

    def _dispatch(self, events: list[Event]) -> None:
        if not events:
            return
        shared: dict[int, tuple[queue.Queue[list[Event]], list[Event]]] = {}
        with self._lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:
                    continue
                if stream.outbox is None:
                    stream.events.put(event)
                else:
                    shared.setdefault(id(stream.outbox), (stream.outbox, []))[1].append(event)
                if event.finished:
                    del self._streams[event.request_id]
        for outbox, step_events in shared.values():
            outbox.put(step_events)
