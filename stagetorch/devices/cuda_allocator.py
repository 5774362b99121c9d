"""A model of PyTorch's CUDA caching allocator: the bytes a sequence of allocations reserves from the driver.

``torch.cuda.max_memory_allocated`` counts the blocks tensors hold; ``max_memory_reserved`` counts the
segments the caching allocator took from the driver to cut them from, which is what a process's memory cap
(``torch.cuda.set_per_process_memory_fraction``) and the card bound. The gap is the allocator's own: its
rounding, its segment sizes, and free blocks it cannot fit the next request into. This module replays a
sequence of allocations and frees through the allocator's rules, read from ``c10/cuda/CUDACachingAllocator.cpp``
(PyTorch 2.x), and reports both peaks:

- every request is rounded up to a multiple of 512 bytes (:data:`BLOCK_ROUND`);
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the large pool,
  whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB above;
- a request takes the smallest cached free block of its pool and stream that fits (ties: the lowest address),
  and splits it when what is left is more than 1 MiB (large pool) or at least 512 bytes (small pool);
- a freed block merges with free neighbours of its segment;
- ``max_split_size``: blocks of that size or more are never split, a smaller request never takes one, and a
  larger request takes one at most 20 MiB (``max_non_split_rounding``) larger than itself;
- when the driver cannot give a segment (``memory_limit``, the process's cap), cached free blocks are
  handed back (oversize ones first, then every whole free segment: ``release_cached_blocks``) and the request
  tried once more; failing that, :class:`AllocatorOutOfMemory`;
- ``expandable_segments=True`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): one segment per pool
  and stream that grows by mapping pages (2 MiB for the small pool, 20 MiB for the large) at its lowest
  free address, and every split leaves its remainder.

Not modelled: several streams' events (a block freed while another stream uses it), CUDA graphs' private
pools, ``garbage_collection_threshold``, ``roundup_power2_divisions``.

The model (:class:`CachingAllocatorModel`, :func:`replay`) knows the allocator and nothing of the IR;
:func:`allocator_settings` reads the options this process's allocator runs with.
:mod:`stagetorch.planning.reserved` feeds it a planned step's allocation order.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "BLOCK_ROUND", "SMALL_REQUEST", "SMALL_SEGMENT", "LARGE_SEGMENT", "MIN_LARGE_ALLOC", "LARGE_ROUND",
    "rounded", "segment_size", "CachingAllocatorModel", "AllocatorStats", "AllocatorOutOfMemory", "replay",
    "allocator_settings",
]

MiB = 1 << 20
BLOCK_ROUND = 512  # kMinBlockSize: every block is a multiple of this
SMALL_REQUEST = 1 * MiB  # kSmallSize: the largest request the small pool serves
SMALL_SEGMENT = 2 * MiB  # kSmallBuffer: the small pool's segments, and its expandable pages
LARGE_SEGMENT = 20 * MiB  # kLargeBuffer: the large pool's segments for requests under MIN_LARGE_ALLOC, and its pages
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a request gets a segment of its own size
LARGE_ROUND = 2 * MiB  # kRoundLarge: a segment of its own size is rounded up to this
_NO_LIMIT = 1 << 64  # max_split_size unset: SIZE_MAX
# Where the modelled driver's addresses start: CUDA hands out device addresses downwards from high in the
# 47-bit space; only their order matters (best fit breaks ties by address).
_TOP_ADDRESS = 1 << 47
# An expandable segment reserves address space for the whole card and more (1 1/8 of its memory); the
# model's is large enough for any card.
_EXPANDABLE_SPAN = 1 << 42


def rounded(size: int) -> int:
    """The block size the allocator gives a request of ``size`` bytes."""
    return max(-(-size // BLOCK_ROUND) * BLOCK_ROUND, BLOCK_ROUND)


def segment_size(block: int) -> int:
    """The segment the allocator asks the driver for when no cached block fits a ``block``-byte block."""
    if block <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if block < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-block // LARGE_ROUND) * LARGE_ROUND


class AllocatorOutOfMemory(Exception):
    """The modelled allocator could not get a segment within its ``memory_limit``, even after handing its
    cached blocks back: the real one raises ``torch.OutOfMemoryError`` here."""


class _Block:
    """A range of one segment: allocated, cached free, or (in an expandable segment) not mapped."""

    __slots__ = ("address", "size", "small", "stream", "allocated", "mapped", "prev", "next", "segment")

    def __init__(self, address: int, size: int, small: bool, stream: int, segment: _Expandable | None = None):
        self.address, self.size, self.small, self.stream = address, size, small, stream
        self.allocated, self.mapped = False, True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment  # the expandable segment it lies in; None for a segment of its own

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.address)  # the free set's order: best fit, then lowest address


class _Expandable:
    """One expandable segment: a span of addresses mapped page by page."""

    __slots__ = ("base", "page", "span")

    def __init__(self, base: int, page: int, span: int):
        self.base, self.page, self.span = base, page, span


class _Pool:
    """The cached free blocks of one pool, in the allocator's order; and its unmapped ranges by address."""

    def __init__(self, small: bool):
        self.small = small
        self.free: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], _Block] = {}
        self.unmapped: list[tuple[int, int]] = []  # (stream, address)
        self.unmapped_blocks: dict[tuple[int, int], _Block] = {}

    def add(self, b: _Block) -> None:
        if b.mapped:
            bisect.insort(self.free, b.key)
            self.blocks[b.key] = b
        else:
            bisect.insort(self.unmapped, (b.stream, b.address))
            self.unmapped_blocks[(b.stream, b.address)] = b

    def remove(self, b: _Block) -> None:
        if b.mapped:
            del self.free[bisect.bisect_left(self.free, b.key)]
            del self.blocks[b.key]
        else:
            del self.unmapped[bisect.bisect_left(self.unmapped, (b.stream, b.address))]
            del self.unmapped_blocks[(b.stream, b.address)]

    def fits(self, stream: int, size: int) -> Iterator[_Block]:
        """Free mapped blocks of ``stream`` of at least ``size`` bytes, smallest first."""
        for key in self.free[bisect.bisect_left(self.free, (stream, size, 0)):]:
            if key[0] != stream:
                return
            yield self.blocks[key]


@attrs.frozen
class AllocatorStats:
    """What a replay did: the peaks ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` would
    report over it, the bytes held at its end, and each segment it took from the driver (or expandable
    pages it mapped) and gave back, in order."""

    allocated: int
    max_allocated: int
    reserved: int
    max_reserved: int
    segment_allocs: tuple[int, ...]
    segment_frees: tuple[int, ...]
    retries: int

    @property
    def reserved_over_allocated(self) -> float:
        """Reserved over allocated at their peaks: what the allocator adds to what tensors hold."""
        return self.max_reserved / max(self.max_allocated, 1)


class CachingAllocatorModel:
    """The caching allocator of one device, in the default configuration unless told otherwise.

    **Arguments:**

    - ``expandable_segments``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
    - ``max_split_size``: ``max_split_size_mb`` in bytes (None: unset, every block may be split).
    - ``max_non_split_rounding``: ``max_non_split_rounding_mb`` in bytes: how much larger than a request of
      ``max_split_size`` or more an unsplittable cached block it takes may be.
    - ``memory_limit``: the bytes the process may reserve (``set_per_process_memory_fraction`` times the
      card's memory, or what the driver has free); None: no limit.
    - ``addresses``: the addresses the driver gives new segments, in order (a recorded trace's, to break
      best fit's ties as the real run did); after them, addresses go down from high memory as CUDA's do.

    ``alloc(size)`` returns a handle (the block's address), which ``free`` takes back.
    """

    def __init__(
        self,
        *,
        expandable_segments: bool = False,
        max_split_size: int | None = None,
        max_non_split_rounding: int = LARGE_SEGMENT,
        memory_limit: int | None = None,
        addresses: Iterable[int] = (),
    ):
        self.expandable_segments = expandable_segments
        self.max_split_size = _NO_LIMIT if max_split_size is None else max_split_size
        self.max_non_split_rounding = max_non_split_rounding
        self.memory_limit = memory_limit
        self._addresses = iter(addresses)
        self._next_address = _TOP_ADDRESS
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._live: dict[int, _Block] = {}
        self.allocated = self.max_allocated = 0
        self.reserved = self.max_reserved = 0
        self._segment_allocs: list[int] = []
        self._segment_frees: list[int] = []
        self._retries = 0

    # -- the public surface -------------------------------------------------------------------------------

    def alloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes on ``stream``, as ``torch.empty`` would; returns the block's address."""
        size = rounded(size)
        pool = self._pools[size <= SMALL_REQUEST]
        block = self._cached_block(pool, size, stream)
        if block is None:
            block = (
                self._new_block(pool, size, stream)
                or (self._release_oversize(pool, size, stream) and self._new_block(pool, size, stream))
                or (self._release_cached() and self._retried() and self._new_block(pool, size, stream))
            )
        if not block:
            raise AllocatorOutOfMemory(
                f"the modelled allocator cannot get {segment_size(size)} bytes for a {size}-byte block: "
                f"{self.reserved} reserved, {self.allocated} allocated, limit {self.memory_limit}"
            )
        if self._should_split(block, size):
            self._split(pool, block, size)
        block.allocated = True
        self._live[block.address] = block
        self.allocated += block.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        return block.address

    def free(self, handle: int) -> None:
        """Free the block ``alloc`` returned ``handle`` for: it goes back to its pool's cache, merged with its
        free neighbours."""
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):
            self._merge(pool, block, neighbour)
        pool.add(block)

    def release_cached_blocks(self) -> None:
        """``torch.cuda.empty_cache()``: hand every whole free segment (and every free expandable page) back."""
        self._release_cached()

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            self.allocated, self.max_allocated, self.reserved, self.max_reserved,
            tuple(self._segment_allocs), tuple(self._segment_frees), self._retries,
        )

    def segments(self) -> list[tuple[int, int, int]]:
        """Each segment held (each mapped range of an expandable one), by address: (address, size, bytes
        allocated in it), as ``torch.cuda.memory_snapshot`` lists them."""
        heads = {}
        for block in itertools.chain(self._live.values(), *(p.blocks.values() for p in self._pools.values())):
            while block.prev is not None and block.prev.mapped:
                block = block.prev
            heads[block.address] = block
        out = []
        for address, block in sorted(heads.items()):
            size = used = 0
            while block is not None and block.mapped:
                size += block.size
                used += block.size if block.allocated else 0
                block = block.next
            out.append((address, size, used))
        return out

    # -- finding a block ----------------------------------------------------------------------------------

    def _cached_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """The cached free block a request takes (get_free_block), out of the cache; None if none fits."""
        candidates = pool.fits(stream, size)
        block = next(candidates, None)
        if block is None:
            return None
        if block.segment is not None:
            # Best fit counts a block at the end of an expandable segment's mapped range as large as it can
            # grow: a larger block that grows less is taken first.
            for larger in candidates:
                if _growable(larger) >= _growable(block):
                    break
                block = larger
        if size < self.max_split_size <= block.size:
            return None  # an oversize block is not cut for a smaller request
        if size >= self.max_split_size and block.size >= size + self.max_non_split_rounding:
            return None
        pool.remove(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable_segments:
            return remaining >= BLOCK_ROUND
        return size < self.max_split_size and remaining > SMALL_REQUEST

    def _split(self, pool: _Pool, block: _Block, size: int) -> None:
        """Cut ``block`` to ``size`` bytes; what is left after it goes back to the cache."""
        rest = _Block(block.address + size, block.size - size, block.small, block.stream, block.segment)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        pool.add(rest)

    def _merge(self, pool: _Pool, block: _Block, other: _Block | None) -> None:
        """Merge the free ``other`` into its neighbour ``block`` (both mapped, or both not)."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return
        pool.remove(other)
        if other is block.prev:
            block.address, block.prev = other.address, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    # -- segments from the driver -------------------------------------------------------------------------

    def _driver_address(self, size: int) -> int:
        address = next(self._addresses, None)
        if address is None:
            self._next_address -= size
            address = self._next_address
        return address

    def _within_limit(self, size: int) -> bool:
        return self.memory_limit is None or self.reserved + size <= self.memory_limit

    def _reserve(self, size: int) -> None:
        self.reserved += size
        self.max_reserved = max(self.max_reserved, self.reserved)
        self._segment_allocs.append(size)

    def _unreserve(self, size: int) -> None:
        self.reserved -= size
        self._segment_frees.append(size)

    def _new_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """A free block of at least ``size`` bytes made from memory the driver gives (alloc_block)."""
        whole = segment_size(size)
        if not self._within_limit(whole):  # checked at the segment's size in both modes, as the allocator does
            return None
        if self.expandable_segments:
            return self._grow(pool, size, stream)
        self._reserve(whole)
        return _Block(self._driver_address(whole), whole, pool.small, stream)

    def _grow(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """A free block of ``size`` bytes at the lowest address of an expandable segment where mapping pages
        makes one (try_allocate_expandable_block)."""
        block = self._expandable_room(pool, size, stream)
        if not block.mapped:
            block = self._map(pool, block, min(block.size, size))
            if block is None:
                return None
        while block.size < size:
            grown = self._map(pool, block.next, min(size - block.size, block.next.size))
            if grown is None:
                return None
            block = grown
        pool.remove(block)
        return block

    def _expandable_room(self, pool: _Pool, size: int, stream: int) -> _Block:
        """The lowest block from which free and unmapped blocks run for ``size`` bytes; a new segment if none."""
        for key in pool.unmapped[bisect.bisect_left(pool.unmapped, (stream, 0)):]:
            if key[0] != stream:
                break
            start = pool.unmapped_blocks[key]
            if start.prev is not None and not start.prev.allocated:
                start = start.prev
            room, b = 0, start
            while room < size and b is not None and not b.allocated:
                room, b = room + b.size, b.next
            if room >= size:
                return start
        page = SMALL_SEGMENT if pool.small else LARGE_SEGMENT
        segment = _Expandable(self._driver_address(_EXPANDABLE_SPAN), page, _EXPANDABLE_SPAN)
        block = _Block(segment.base, segment.span, pool.small, stream, segment)
        block.mapped = False
        pool.add(block)
        return block

    def _map(self, pool: _Pool, block: _Block, size: int) -> _Block | None:
        """Map the pages under the first ``size`` bytes of the unmapped ``block``; returns the free mapped
        block they join (with free mapped neighbours), in the cache; None past the limit."""
        page, base = block.segment.page, block.segment.base
        end = base + -(-(block.address + size - base) // page) * page
        mapped = end - block.address
        if not self._within_limit(mapped):
            return None
        pool.remove(block)
        if mapped < block.size:
            rest = _Block(end, block.size - mapped, block.small, block.stream, block.segment)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped
            pool.add(rest)
        block.mapped = True
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add(block)
        self._reserve(mapped)
        return block

    def _retried(self) -> bool:
        self._retries += 1
        return True

    def _release_oversize(self, pool: _Pool, size: int, stream: int) -> bool:
        """Hand back cached oversize blocks until ``size`` (at least max_split_size) bytes are freed
        (release_available_cached_blocks); only with ``max_split_size`` set."""
        if self.max_split_size == _NO_LIMIT:
            return False
        want = max(size, self.max_split_size)
        fit = next(pool.fits(stream, want), None)
        if fit is not None:
            self._release_segment(pool, fit)
            return True
        oversize = list(pool.fits(stream, self.max_split_size))
        freed = 0
        for block in reversed(oversize):
            if freed >= want:
                break
            freed += block.size
            self._release_segment(pool, block)
        return freed >= want

    def _release_segment(self, pool: _Pool, block: _Block) -> None:
        pool.remove(block)
        self._unreserve(block.size)

    def _release_cached(self) -> bool:
        """Hand every whole free segment back, and unmap every free page of expandable segments (release_cached_blocks)."""
        for pool in (self._pools[False], self._pools[True]):
            for block in list(pool.blocks.values()):
                if block.segment is not None:
                    self._unmap(pool, block)
                elif block.prev is None and block.next is None:
                    self._release_segment(pool, block)
        return True

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """Unmap the whole pages inside the free ``block`` of an expandable segment."""
        page, base = block.segment.page, block.segment.base
        start = base + -(-(block.address - base) // page) * page
        end = base + (block.address + block.size - base) // page * page
        if end <= start:
            return
        pool.remove(block)
        for lo, hi, before in ((block.address, start, True), (end, block.address + block.size, False)):
            if hi > lo:  # the free mapped pieces left on either side of the unmapped pages
                piece = _Block(lo, hi - lo, block.small, block.stream, block.segment)
                if before:
                    piece.prev, piece.next = block.prev, block
                    if block.prev is not None:
                        block.prev.next = piece
                    block.prev = piece
                else:
                    piece.prev, piece.next = block, block.next
                    if block.next is not None:
                        block.next.prev = piece
                    block.next = piece
                pool.add(piece)
        block.address, block.size, block.mapped = start, end - start, False
        self._unreserve(end - start)
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        if block.prev is None and block.next is None:
            return  # the whole segment is unmapped: its address space goes back too
        pool.add(block)


def _growable(block: _Block) -> int:
    """A free block's size with the unmapped range after it, into which it can grow."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


# ---------------------------------------------------------------------------------------------------------
# Replaying an allocation order.

# The trace's actions (torch.cuda.memory._snapshot()'s device_traces) and what the model does for each: a
# free is requested and completed at once when no other stream holds the block, so only the completion acts.
_ACTIONS = {"alloc": "alloc", "free": "free", "free_completed": "free", "free_requested": None,
            "segment_alloc": None, "segment_free": None, "segment_map": None, "segment_unmap": None}


def replay(events: Iterable[Sequence[Any]], model: CachingAllocatorModel | None = None) -> AllocatorStats:
    """Run ``events`` through ``model`` (a default one if None) and return what it reserved.

    Each event is ``(action, key, size)`` (more fields are ignored): ``"alloc"`` allocates ``size`` bytes
    for ``key`` (any hashable that names the allocation while it lives: a trace's address, a Var);
    ``"free"`` frees the live allocation of ``key``. A recorded trace's actions are read as the allocator
    wrote them: ``free_completed`` frees, ``free_requested`` and the segment events (what the model is to
    predict) are skipped."""
    model = model if model is not None else CachingAllocatorModel()
    handles: dict[Any, int] = {}
    for event in events:
        action = _ACTIONS[event[0]]
        if action == "alloc":
            handles[event[1]] = model.alloc(event[2])
        elif action == "free":
            model.free(handles.pop(event[1]))
    return model.stats()


# The allocator options the model follows, as PYTORCH_ALLOC_CONF spells them: (model option, parse).
_SETTINGS = {
    "expandable_segments": ("expandable_segments", lambda v: v.strip().lower() == "true"),
    "max_split_size_mb": ("max_split_size", lambda v: int(v) * MiB),
    "max_non_split_rounding_mb": ("max_non_split_rounding", lambda v: int(v) * MiB),
}


def allocator_settings(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The :class:`CachingAllocatorModel` options this process's allocator runs with, from
    ``PYTORCH_ALLOC_CONF`` (or the older ``PYTORCH_CUDA_ALLOC_CONF``): ``expandable_segments``,
    ``max_split_size_mb`` and ``max_non_split_rounding_mb``; others are not modelled."""
    conf = environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    options = {}
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() in _SETTINGS:
            name, parse = _SETTINGS[key.strip()]
            options[name] = parse(value)
    return options
