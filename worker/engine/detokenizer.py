"""Incremental detokenisation: text deltas that never split a character, cut at stop strings."""

from __future__ import annotations

import re

try:
    from tokenizers.decoders import DecodeStream
except ImportError:   # tokenizers without a streaming decoder: every tokenizer decodes by windows
    DecodeStream = None


def _stream_for(tokenizer, skip_special_tokens: bool = True):
    """(Rust tokenizer, its streaming decoder) when the tokenizer has one that decodes as it does, else
    (None, None)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or backend is None or not hasattr(backend, "decode"):
        return None, None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):   # a Python pass the stream does not make
        return None, None
    return backend, DecodeStream(skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    With a Rust ("fast") tokenizer, each token goes through its streaming decoder (`DecodeStream`): one
    native call per token, which returns nothing while a multi-byte character is unfinished. Otherwise a
    window of recent tokens is decoded twice per token, and a window whose text ends in U+FFFD waits for the
    next token. Both keep each step O(1). Text that could be the start of a stop string is held back, so the
    deltas always add up to the final text.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop   # the text ends after the matched stop string rather than before it
        self.matched: str | None = None    # the stop string that ended the text
        self.skip_special_tokens = skip_special_tokens
        self.armed = True   # False: stop strings are not looked for yet (min_tokens); text shown meanwhile stays
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False
        # Every proper prefix of a stop string: an unshown tail that is one of them is held back.
        self.stop_prefixes = {s[:n] for s in stop for n in range(1, len(s))}
        self.longest_prefix = max((len(s) - 1 for s in stop), default=0)
        self.backend, self.stream = _stream_for(tokenizer, skip_special_tokens)
        self.fed = 0   # tokens the stream has seen

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

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

    def push_token(self, token: int) -> str:
        """push([token]), with the streaming decoder's common case written out: it runs for every row of every
        decode step."""
        stream = self.stream
        if stream is None or self.stopped or self.fed != len(self.ids):
            return self.push([token])
        self.ids.append(token)
        self.fed += 1
        piece = stream.step(self.backend, token)
        if piece:
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, self.fed
        if self.stop and self.armed:
            return self._release(final=False)
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta

    def flush(self) -> str:
        """The request is over: release everything held back."""
        if not self.stopped:
            self._advance(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        upto = len(self.text)
        if self.stop and not self.stopped and self.armed:
            found = self._find_stop()
            if found is not None:
                cut, self.matched = found
                if self.include_stop:
                    cut += len(self.matched)
                self.text = self.text[:cut]
                self.stopped = True
                upto = cut
            elif not final:
                upto -= self._held_back()
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        """The earliest stop string in the text (where it starts, which one), if any."""
        # Shown text never ends in the start of a stop string, so a match begins in the unshown part.
        text, start, first, which = self.text, self.emitted, -1, None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (first < 0 or i < first):
                first, which = i, s
        return (first, which) if which is not None else None

    def _held_back(self) -> int:
        """Length of the longest unshown tail that a stop string could begin with."""
        text, prefixes = self.text, self.stop_prefixes
        for n in range(min(len(text) - self.emitted, self.longest_prefix), 0, -1):
            if text[-n:] in prefixes:
                return n
        return 0


# ---- each token's own bytes (OpenAI's logprobs `token` and `bytes` fields) ------------------------------------------

def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_DECODER = _byte_decoder()
_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """Each token id's own bytes, which need not be whole characters.

    Byte-level BPE vocabularies (GPT-2, SmolLM2, Qwen) spell bytes with printable stand-ins ("Ġ" is a space):
    they are mapped back. SentencePiece ones spell a space as "▁" and a byte it has no piece for as "<0xNN>".
    Added tokens (<|im_end|>, say) are their own text.
    """
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    byte_level = _is_byte_level(tokenizer)
    out: list[bytes] = []
    for token_id, piece in zip(ids, pieces):
        if piece is None:
            out.append(b"")
        elif token_id in added:
            out.append(added[token_id].content.encode())
        elif byte_level:
            out.append(b"".join(bytes([BYTE_DECODER[c]]) if c in BYTE_DECODER else c.encode() for c in piece))
        elif match := _HEX_BYTE.match(piece):
            out.append(bytes([int(match.group(1), 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out
