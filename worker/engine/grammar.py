"""Grammar-constrained decoding: structures compiled once per tokenizer, and each step's masks of allowed tokens."""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.numpy
import torch

from structured import Structure, StructureError

from .sampler import GrammarMasks
from .sampling_params import InvalidParamsError
from .transfer import upload

COMPILED_CAPACITY = 128   # distinct structures kept compiled (an LRU): tool sets and response formats repeat


class Grammars:
    """Matchers for one tokenizer and one logits width.

    `matcher` runs in the caller's thread (a request is refused there when its structure does not compile);
    `masks` runs in the engine's loop. llguidance computes masks with the GIL released, many rows in parallel.
    """

    def __init__(self, tokenizer, eos_ids: set[int], vocab: int, capacity: int = COMPILED_CAPACITY) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.vocab = vocab                 # the logits' width: a model's lm_head may be wider than its tokenizer
        self.capacity = capacity
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self.compiles = 0

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about 0.3 s for a 49k vocabulary), so engines that never constrain never pay."""
        with self._lock:
            if self._lltokenizer is None:
                # Ids past the tokenizer's (an lm_head padded wider) are in every mask, never allowed.
                width = max(self.vocab, len(self.tokenizer))
                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=width,
                                                                 eos_token=self.eos_ids or None)
            return self._lltokenizer

    def matcher(self, structure: Structure) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `structure`; raises InvalidParamsError when it cannot be compiled."""
        key = structure.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = self._compile(structure)
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, structure: Structure) -> llguidance.LLMatcher:
        try:
            grammar = structure.grammar()
        except StructureError as exc:
            raise InvalidParamsError(f"structure: {exc}") from None
        try:
            lltokenizer = self.lltokenizer
        except ValueError as exc:   # llguidance reads fast (Rust) tokenizers only
            raise InvalidParamsError(f"structure: this model's tokenizer cannot constrain answers: {exc}") from None
        compiled = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise InvalidParamsError(f"structure: the grammar cannot be used: {compiled.get_error()}")
        self.compiles += 1
        return compiled

    def masks(self, matchers: list[llguidance.LLMatcher | None], device: torch.device) -> GrammarMasks:
        """Allowed tokens for each row with a matcher (every row's last token must have been consumed)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        # llguidance.numpy's, not llguidance.torch's: that module runs torch.compile as it is imported (dynamo and
        # inductor, 4.7 s of every process that imports the engine). Pinned on CUDA, for a copy that does not wait.
        bits = torch.full(llguidance.numpy.get_bitmask_shape(len(rows), self.lltokenizer.vocab_size), -1,
                          dtype=torch.int32, pin_memory=device.type == "cuda")
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(matchers[r], j) for j, r in enumerate(rows)],
                                                     bits.numpy())
        return GrammarMasks(
            rows=upload(rows, torch.int64, device),
            bits=bits.to(device, non_blocking=True),
            every_row=len(rows) == len(matchers))
