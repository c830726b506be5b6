"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts and a prefix cache keyed by content."""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class BlockManager:
    """Hands out KV blocks to sequences and shares full blocks whose token prefix is identical.

    A full block is immutable, so it is named by a hash of its tokens chained with the previous
    block's hash. Freed blocks keep that name while they sit in the free list: a later request with
    the same prefix (the shared system prompt) takes them back instead of recomputing them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Least recently freed first: eviction of cached content takes the oldest.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _chain_hashes(self, token_ids: list[int], num_full_blocks: int) -> list[int]:
        hashes, prev = [], 0
        bs = self.block_size
        for i in range(num_full_blocks):
            prev = hash((prev, tuple(token_ids[i * bs:(i + 1) * bs])))
            hashes.append(prev)
        return hashes

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _take_fresh(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Attach the longest run of cached full blocks to a sequence with no blocks; return tokens covered."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        # At least one token must be computed: its logits give the next token.
        num_full = (seq.num_tokens - 1) // self.block_size
        self.prefix_query_tokens += num_full * self.block_size
        for h in self._chain_hashes(seq.token_ids, num_full):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_table.append(block)
        covered = len(seq.block_table) * self.block_size
        self.prefix_hit_tokens += covered
        return covered

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold num_tokens; all or nothing."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        seq.block_table.extend(self._take_fresh() for _ in range(need))
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that computing this step filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        num_full = min(seq.num_computed_tokens // bs, len(table))
        first = num_full
        while first > 0 and self.block_hash[table[first - 1]] is None:
            first -= 1
        prev = self.block_hash[table[first - 1]] if first > 0 else 0
        for i in range(first, num_full):
            prev = hash((prev, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
            self.block_hash[table[i]] = prev
            self.hash_to_block.setdefault(prev, table[i])

    def release(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table.clear()
