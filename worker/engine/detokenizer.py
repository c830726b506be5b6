"""Incremental detokenisation: text deltas that never split a character, cut at stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding only a window of recent tokens keeps each step O(1); a window whose text ends in
    U+FFFD is an unfinished multi-byte character and waits for the next token. Text that could be
    the start of a stop string is held back, so the deltas always add up to the final text.
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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
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
