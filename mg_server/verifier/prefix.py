"""The verifier's prefix cache: K/V blocks of earlier requests, reused by requests that begin alike.

A position's K/V depends only on the tokens up to it (batch- and chunk-invariant kernels: the
bits do not depend on which forward, chunk or neighbours computed it), so a block of BLOCK
positions computed for one request holds exactly what another request with the same first tokens
would compute. The engine registers every whole block a request has computed (`register`; one
cached already is mapped in its place, so the chain goes on), and a request maps the longest
chain of cached blocks its prompt goes on with (`match`), at its first item and at each later
chunk of its prompt while every position it holds is a cached block's, instead of computing it:
a shared few-shot preamble, n samples of one prompt, a judge's rubric cost their prefix once.

Guard (no request reads K/V of tokens it does not have): a block is found by a digest of its
tokens and its parent, then its tokens and its parent are compared exactly, so a digest collision
reuses nothing. A cached block's slots are read-only: requests write only slots the engine pops
from its free list, and a slot returns there only when its block is evicted, which happens only
while no live request maps it (refs == 0). Eviction takes the least recently used unmapped leaf
first (a block whose descendants are cached stays: they are reached through it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

# Positions per cached block. Why 16: a shared preamble is reused up to its last whole block
# (at most 15 positions recomputed), and a block's lookup (a digest, a dict probe, a compare)
# costs ~2 us, 0.5 ms for an 8k-token prompt.
BLOCK = 16


@dataclass(eq=False)
class Block:
    key: bytes  # digest of (parent's key, tokens)
    parent: Block | None  # the block before it (None: the first block of a sequence)
    tokens: tuple[int, ...]  # [BLOCK] token ids of its positions
    slots: list[int]  # [BLOCK] pool slots holding their K/V (the cache owns them)
    refs: int = 0  # live requests that map it
    children: int = 0  # cached blocks whose parent it is


def block_key(parent: Block | None, tokens: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(parent.key if parent is not None else b"", digest_size=16)
    h.update(repr(tokens).encode())
    return h.digest()


class PrefixCache:
    def __init__(self):
        self.blocks: dict[bytes, Block] = {}
        self.idle: OrderedDict[bytes, Block] = OrderedDict()  # refs == 0, least recently used first
        self.hits = 0  # positions mapped from the cache (reused rows)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def idle_slots(self) -> int:
        """Slots the cache could give back now (unmapped blocks)."""
        return BLOCK * len(self.idle)

    def find(self, parent: Block | None, tokens: tuple[int, ...]) -> Block | None:
        """The cached block of `tokens` after `parent`, if any."""
        b = self.blocks.get(block_key(parent, tokens))
        # the guard (module doc): a digest match is not a token match
        if b is None or b.parent is not parent or b.tokens != tokens:
            return None
        return b

    def match(self, tokens: list[int], limit: int, parent: Block | None = None) -> list[Block]:
        """The cached blocks that the first `limit` positions of `tokens` begin with (whole
        blocks only), in order, following `parent` (None: a sequence's first block). Not yet
        mapped: `take` them."""
        out: list[Block] = []
        for k in range(max(0, limit) // BLOCK):
            b = self.find(parent, tuple(tokens[k * BLOCK:(k + 1) * BLOCK]))
            if b is None:
                break
            out.append(b)
            parent = b
        return out

    def take(self, blocks: list[Block]) -> None:
        """A request maps these blocks (match's, in order)."""
        for b in blocks:
            b.refs += 1
            self.idle.pop(b.key, None)

    def drop(self, blocks: list[Block]) -> None:
        """A request no longer maps these blocks: the unmapped ones become evictable, the deepest
        first (a leaf before its parent)."""
        for b in reversed(blocks):
            b.refs -= 1
            if b.refs == 0:
                self.idle[b.key] = b
                self.idle.move_to_end(b.key)

    def register(self, parent: Block | None, tokens: tuple[int, ...], slots: list[int]) -> Block | None:
        """Cache a block a request computed (its slots pass to the cache; the request maps it:
        refs 1). None if an equal block is cached already (the request keeps its slots)."""
        key = block_key(parent, tokens)
        if key in self.blocks:
            return None
        b = Block(key, parent, tokens, list(slots), refs=1)
        self.blocks[key] = b
        if parent is not None:
            parent.children += 1
        return b

    def evict_one(self) -> list[int]:
        """The least recently used unmapped leaf's slots (the cache forgets it); [] if none."""
        for key, b in self.idle.items():
            if b.children == 0:
                del self.idle[key]
                del self.blocks[key]
                if b.parent is not None:
                    b.parent.children -= 1
                return b.slots
        return []
