"""Incremental detokenisation: text deltas that never split a character, cut at stop strings."""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:   # tokenizers without a streaming decoder: every tokenizer decodes by windows
    DecodeStream = None


def _stream_for(tokenizer):
    """(Rust tokenizer, its streaming decoder) when the tokenizer has one that decodes as it does, else
    (None, None)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or backend is None or not hasattr(backend, "decode"):
        return None, None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):   # a Python pass the stream does not make
        return None, None
    return backend, DecodeStream(skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    With a Rust ("fast") tokenizer, each token goes through its streaming decoder (`DecodeStream`): one
    native call per token, which returns nothing while a multi-byte character is unfinished. Otherwise a
    window of recent tokens is decoded twice per token, and a window whose text ends in U+FFFD waits for the
    next token. Both keep each step O(1). Text that could be the start of a stop string is held back, so the
    deltas always add up to the final text.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.backend, self.stream = _stream_for(tokenizer)
        self.fed = 0   # tokens the stream has seen

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        if self.stream is not None and not final:
            for i in range(self.fed, len(self.ids)):
                piece = self.stream.step(self.backend, self.ids[i])
                if piece:
                    self.text += piece
                    self.prefix_offset, self.read_offset = self.read_offset, i + 1
            self.fed = len(self.ids)
            return
        # Windowed: also the final flush of a stream, which shows what an unfinished character left.
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to show."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        self._advance(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """The request is over: release everything held back."""
        if not self.stopped:
            self._advance(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        upto = len(self.text)
        if self.stop and not self.stopped:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                upto = cut
            elif not final:
                upto -= self._held_back()
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta

    def _find_stop(self) -> int | None:
        # Shown text never ends in the start of a stop string, so a match begins in the unshown part.
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest unshown tail that a stop string could begin with."""
        pending = len(self.text) - self.emitted
        for n in range(min(pending, max(len(s) for s in self.stop) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
