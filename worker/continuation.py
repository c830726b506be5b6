"""A handed-back answer goes on from what its customer was shown: the record of that text and its tokens."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from json.encoder import encode_basestring

from worker.engine import InvalidRequestError, LLMEngine, RequestStream, TokenDelta

log = logging.getLogger(__name__)


class Written(TokenDelta):
    """Text the worker wrote itself (a grounded answer's lead), sent as the model's is: a redelivery shows it again
    as it was, and never takes it for the model's."""


def tokens_of(delta: TokenDelta) -> list[int] | None:
    """The tokens that wrote a delta's text as its record keeps them: None for the worker's own."""
    return None if isinstance(delta, Written) else delta.token_ids


def _kind(tokens: list[int] | None) -> bool | None:
    """None: the worker's own text; False: the model's, its tokens not known (a tool parser's output); True: the
    model's with its tokens."""
    return None if tokens is None else bool(tokens)


def record(parts: list[tuple[str, list[int] | None]], skip: int) -> str:
    """The record of a sent delta made of `parts` (each delta's text and the tokens that wrote it; None for the
    worker's own text), less its first `skip` characters (shown by an earlier delivery): a JSON list of
    [text, tokens or null], one per run of parts of one _kind, and last ["", tokens] where the delta ends inside a
    character (its first bytes, sent with their log-probabilities: the answer goes on after them too)."""
    if not skip and parts[-1][0] and all(tokens for _, tokens in parts):   # for every request of every window
        text = encode_basestring("".join(text for text, _ in parts))
        return f"[[{text},[{','.join(str(t) for _, tokens in parts for t in tokens)}]]]"
    runs: list[list] = []
    carried: list[int] = []   # tokens of a part without text (a character's first bytes): the next part's
    for text, tokens in parts:
        if skip and skip >= len(text):
            skip -= len(text)
            continue
        # A part cut by `skip` keeps its tokens: they then write more than its text, and tokens() finds that out.
        text, skip = text[skip:], 0
        if tokens is not None:
            tokens, carried = carried + tokens, []
        if not text:
            carried = tokens or []
        elif runs and _kind(runs[-1][1]) == _kind(tokens):
            runs[-1][0] += text
            if tokens is not None:
                runs[-1][1] += tokens
        else:
            runs.append([text, None if tokens is None else list(tokens)])
    if carried:
        runs.append(["", carried])
    return json.dumps(runs, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Shown:
    """Choice 0's text as its clients were sent it, in pieces: each piece's text and the tokens that wrote it (none
    known: an empty list; None: the worker's own text)."""

    pieces: list[tuple[str, list[int] | None]]

    @classmethod
    def read(cls, entries: list[bytes | str], chars: int) -> Shown | None:
        """The record as Redis keeps it; None when it does not hold the `chars` characters clients were sent (it
        expired, a worker that kept none sent them, or it cannot be read)."""
        try:
            pieces = [(text, tokens) for entry in entries for text, tokens in json.loads(entry)]
            if not all(isinstance(text, str) and (tokens is None or isinstance(tokens, list))
                       for text, tokens in pieces):
                return None
        except (ValueError, TypeError):
            return None
        shown = cls(pieces)
        return shown if pieces and len(shown.text) == chars else None

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)

    def split_lead(self) -> tuple[str, Shown]:
        """The text at the start that the worker wrote (a grounded answer's lead), and the rest."""
        n = 0
        while n < len(self.pieces) and self.pieces[n][1] is None:
            n += 1
        return "".join(text for text, _ in self.pieces[:n]), Shown(self.pieces[n:])

    def tokens(self, tokenizer, skip_special_tokens: bool = True) -> list[int] | None:
        """Tokens that write exactly this text: each piece's own where they write it, the piece's text tokenized
        again where they do not (a delta cut by an earlier redelivery, a model with another vocabulary). None when
        no tokens write it. Special tokens recorded (an earlier generation's end, before a tool's result) are left
        out: the answer goes on from its text."""
        special = set(tokenizer.all_special_ids)

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        ids: list[int] = []
        carried: list[int] = []   # a piece without text (a character's first bytes): the next one's, or the last
        for text, tokens in self.pieces:
            tokens = carried + [t for t in tokens or () if t not in special]
            if not text:
                carried = tokens
                continue
            carried = []
            ids += tokens if tokens and decode(tokens) == text else encode(text)
        if decode(ids) == self.text:
            return ids + carried
        ids = encode(self.text)
        return ids if decode(ids) == self.text else None


def submit(engine: LLMEngine, request_id: str, prompt_ids: list[int], continued: list[list[int]] | None,
           **kwargs) -> RequestStream:
    """engine.submit, each choice's answer going on after its tokens in `continued` (what an earlier delivery
    showed) where the engine can continue it; where it cannot (say an answer already has every token it may),
    the answers are generated again from their start, as each stream resumes after the characters shown."""
    count = sum(len(tokens) for tokens in continued or ())
    if count:
        try:
            stream = engine.submit(request_id, prompt_token_ids=prompt_ids, continued=continued, **kwargs)
            log.info("%s goes on from the %d tokens shown before", request_id, count)
            return stream
        except InvalidRequestError as exc:
            if "already in use" in str(exc):
                raise
            log.warning("%s cannot go on from the %d tokens shown before (%s); generating it again", request_id,
                        count, exc)
    return engine.submit(request_id, prompt_token_ids=prompt_ids, **kwargs)
