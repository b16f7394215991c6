"""Physical memory behind the elastic KV pool: which bytes of the KV buffers are backed, and giving them back.

Two backends with one interface (`KVBacking`), so `ElasticKVCache` (elastic_kv.py) keeps one set of
bookkeeping:

- `HostKVBacking` (CPU, and any pool whose tensors were allocated whole): the tensors exist at full size;
  "backed bytes" are the logical bytes of the usable tokens, `capacity * bytes_per_token`. Releasing is
  immediate.
- `VmmKVBacking` (CUDA): the pool's buffers live in SGLang's CUDA virtual-memory reservation
  (`kv_vmm_backing.py`, `SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`), but mapped by `ElasticKvVmmBufferOwner`
  in fixed-size chunks of one granule-multiple each, one physical handle per chunk. SGLang's own owner maps
  one handle per extension and never unmaps (its only unmap is close()); fixed chunks are what make the
  tail unmappable handle by handle. Unmapping waits for a CUDA event recorded when the tail was parked, so
  a forward pass still in flight (overlap scheduling) never touches unmapped memory.

Byte counts here are physical on CUDA (chunk-rounded, padded slot page included): they are what the
budget must see, since that is what `cuMemCreate` takes from the GPU.
"""

from __future__ import annotations

import bisect
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

logger = logging.getLogger("pagedweight")


class KVBacking(Protocol):
    def bytes_at(self, tokens: int) -> int:
        """Backed bytes once exactly `tokens` usable tokens are backed (and nothing past them)."""
        ...

    def mapped_bytes(self) -> int:
        """Bytes backed now, including tail memory parked but not yet released (waiting for a fence)."""
        ...

    def bytes_to_grow(self, tokens: int) -> int:
        """Extra bytes that backing `tokens` usable tokens would take now (0 if already backed)."""
        ...

    def round_up(self, tokens: int, limit: int) -> int:
        """The largest token count <= limit that needs no more backing than `tokens` does."""
        ...

    def grow_to(self, tokens: int) -> None:
        """Back the first `tokens` usable tokens (plus the padded slot page). Raises on a driver failure."""
        ...

    def shrink_to(self, tokens: int, stream: Any = None) -> None:
        """Schedule the release of backing past `tokens`; `poll()` performs it once it is safe."""
        ...

    def poll(self) -> int:
        """Release what became safe to release; returns the bytes released by this call."""
        ...

    def close(self) -> None:
        ...


class HostKVBacking:
    """Whole tensors, logical accounting: `bytes_per_token` per usable token, released at once."""

    def __init__(self, bytes_per_token: int, tokens: int) -> None:
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
        self.bytes_per_token = bytes_per_token
        self._tokens = tokens
        self._released = 0

    def bytes_at(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def mapped_bytes(self) -> int:
        return self._tokens * self.bytes_per_token

    def bytes_to_grow(self, tokens: int) -> int:
        return max(0, tokens - self._tokens) * self.bytes_per_token

    def round_up(self, tokens: int, limit: int) -> int:
        return tokens

    def grow_to(self, tokens: int) -> None:
        self._tokens = max(self._tokens, tokens)

    def shrink_to(self, tokens: int, stream: Any = None) -> None:
        if tokens < self._tokens:
            self._released += (self._tokens - tokens) * self.bytes_per_token
            self._tokens = tokens

    def poll(self) -> int:
        released, self._released = self._released, 0
        return released

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------
# CUDA: chunked VMM owner. Runs only on the GPU machine; written against sglang 0.5.17's kv_vmm_backing.
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    addr: int
    size: int
    handle: Any


@dataclass
class _PendingRelease:
    event: Any  # torch.cuda.Event recorded when the tail was parked
    chunks: list[_Chunk] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(c.size for c in self.chunks)


def _chunked_owner_class():
    """Build the subclass lazily: importing kv_vmm_backing needs torch's CUDA extension machinery."""
    from sglang.srt.mem_cache import kv_vmm_backing as vmm

    class ElasticKvVmmBufferOwner(vmm.KvVmmBufferOwner):
        """SGLang's KV VMM owner, mapping every buffer in fixed chunks so its tail can be unmapped.

        Each chunk is one `cuMemCreate` handle mapped at `base + offset + k * chunk` (the last one of a
        buffer clipped to the buffer's granule-aligned span); `_back_spans` (used by SGLang's
        `ensure_prefix` and `finalize`) maps whole chunks, `take_chunks_beyond` detaches the chunks past a
        span for a later `release_chunks`.
        """

        chunk_bytes: int = 0  # set per instance before super().__init__ maps the first page

        def _chunk_lists(self) -> list[list[_Chunk]]:
            lists = getattr(self, "_pw_chunks", None)
            if lists is None or len(lists) != len(self._specs):
                lists = [[] for _ in self._specs]
                self._pw_chunks = lists
            return lists

        def _chunk_size(self) -> int:
            gran = self._arena.granularity
            size = self.chunk_bytes or gran
            if size % gran:
                raise ValueError(f"elastic KV chunk size {size} is not a multiple of the VMM granularity {gran}")
            return size

        def want_bytes(self, spec, span: int) -> int:
            """Bytes of `spec`'s buffer mapped when `span` bytes must be backed: whole chunks, clipped."""
            chunk = self._chunk_size()
            return min(vmm.align_up(int(span), chunk), spec.aligned_reserved)

        def _device_ctx(self):
            return torch.cuda.device(self.device_id)

        def _back_spans(self, span_bytes) -> None:
            if self._arena is None:
                raise RuntimeError("backing after close / before construction")
            for spec, span in zip(self._specs, span_bytes):
                self._check_span(spec, span)
            drv = vmm._driver()
            arena = self._arena
            chunk = self._chunk_size()
            for spec, chunks, span in zip(self._specs, self._chunk_lists(), span_bytes):
                want = self.want_bytes(spec, span)
                with self._device_ctx():
                    while spec.backed_to < want:
                        size = min(chunk, want - spec.backed_to)
                        addr = arena.base + spec.offset + spec.backed_to
                        handle = vmm._check(drv.cuMemCreate(size, arena._prop, 0), "cuMemCreate")
                        try:
                            vmm._check(drv.cuMemMap(addr, size, 0, handle, 0), "cuMemMap")
                            vmm._check(drv.cuMemSetAccess(addr, size, [arena._access], 1), "cuMemSetAccess")
                        except Exception:
                            drv.cuMemUnmap(addr, size)
                            drv.cuMemRelease(handle)
                            raise
                        chunks.append(_Chunk(addr, size, handle))
                        spec.backed_to += size

        def take_chunks_beyond(self, span_bytes) -> list[_Chunk]:
            """Detach every chunk past each buffer's span (still mapped: the caller releases them later)."""
            taken: list[_Chunk] = []
            for spec, chunks, span in zip(self._specs, self._chunk_lists(), span_bytes):
                keep = self.want_bytes(spec, span)
                while chunks and spec.backed_to - chunks[-1].size >= keep:
                    c = chunks.pop()
                    spec.backed_to -= c.size
                    taken.append(c)
            return taken

        def reattach(self, chunks: list[_Chunk], span_bytes) -> list[_Chunk]:
            """A grow needs memory that a shrink detached and has not released yet (its fence is pending):
            take those chunks back, as far as each buffer's span needs them, instead of mapping new ones.
            Returns the chunks still to release."""
            by_addr = {c.addr: c for c in chunks}
            for spec, lst, span in zip(self._specs, self._chunk_lists(), span_bytes):
                want = self.want_bytes(spec, span)
                while spec.backed_to < want:
                    c = by_addr.pop(self._arena.base + spec.offset + spec.backed_to, None)
                    if c is None:
                        break
                    lst.append(c)
                    spec.backed_to += c.size
            return list(by_addr.values())

        @staticmethod
        def release_chunks(chunks: list[_Chunk]) -> None:
            drv = vmm._driver()
            for c in chunks:
                vmm._check(drv.cuMemUnmap(c.addr, c.size), "cuMemUnmap")
                vmm._check(drv.cuMemRelease(c.handle), "cuMemRelease")

        @property
        def backed_bytes(self) -> int:
            return sum(c.size for lst in getattr(self, "_pw_chunks", []) for c in lst)

        def close(self) -> None:
            if self._arena is not None:
                backing = getattr(self, "_pw_backing", None)
                if backing is not None:
                    backing.close()  # chunks parked but not released yet: unmap before the VA is freed
                torch.cuda.synchronize(self.device_id)
                for lst in getattr(self, "_pw_chunks", []):
                    self.release_chunks(lst)
                    lst.clear()
            super().close()

    return ElasticKvVmmBufferOwner


@functools.cache
def elastic_vmm_owner_class():
    """The chunk-mapped subclass of SGLang's VMM buffer owner, built once (it needs SGLang imported)."""
    return _chunked_owner_class()


def _cuda_event_fence(device_id: int) -> Callable[[Any], Any]:
    def record(stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(device_id))
        return event

    return record


class VmmKVBacking:
    """Backing of an MHA or MLA pool whose buffers an `ElasticKvVmmBufferOwner` maps in fixed chunks."""

    def __init__(self, owner: Any, page_size: int, fence: Optional[Callable[[Any], Any]] = None) -> None:
        self.owner = owner
        self.page_size = page_size
        # fence(stream) -> an object with query()/synchronize(), recorded on `stream` (a CUDA event).
        self._fence = fence or _cuda_event_fence(owner.device_id)
        self._pending: list[_PendingRelease] = []
        owner._pw_backing = self

    def _spans(self, tokens: int) -> list[int]:
        # The padded slot page (slot 0) is always backed: final_span_bytes adds it, as SGLang's finalize.
        return [s.desc.final_span_bytes(tokens, self.page_size) for s in self.owner._specs]

    def bytes_at(self, tokens: int) -> int:
        return sum(self.owner.want_bytes(s, span) for s, span in zip(self.owner._specs, self._spans(tokens)))

    def mapped_bytes(self) -> int:
        return self.owner.backed_bytes + sum(p.nbytes for p in self._pending)

    def bytes_to_grow(self, tokens: int) -> int:
        pending_by_spec = self._pending_bytes_by_offset()
        extra = 0
        for spec, span in zip(self.owner._specs, self._spans(tokens)):
            mapped = spec.backed_to + pending_by_spec.get(spec.offset, 0)
            extra += max(0, self.owner.want_bytes(spec, span) - mapped)
        return extra

    def _pending_bytes_by_offset(self) -> dict[int, int]:
        out: dict[int, int] = {}
        base = self.owner._arena.base
        offsets = sorted(s.offset for s in self.owner._specs)
        for p in self._pending:
            for c in p.chunks:
                i = bisect.bisect_right(offsets, c.addr - base) - 1
                out[offsets[i]] = out.get(offsets[i], 0) + c.size
        return out

    def round_up(self, tokens: int, limit: int) -> int:
        ps = self.page_size
        target = self.bytes_at(tokens)
        lo, hi = tokens // ps, max(tokens, limit) // ps  # bytes_at is monotone in tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_at(mid * ps) <= target:
                lo = mid
            else:
                hi = mid - 1
        return max(tokens, lo * ps)

    def grow_to(self, tokens: int) -> None:
        # Chunks parked by a shrink whose release has not run yet are still mapped: take them back first.
        spans = self._spans(tokens)
        kept: list[_PendingRelease] = []
        for p in self._pending:
            rest = self.owner.reattach(p.chunks, spans)
            if rest:
                kept.append(_PendingRelease(p.event, rest))
        self._pending = kept
        self.owner.ensure_prefix(tokens + self.page_size)

    def shrink_to(self, tokens: int, stream: Any = None) -> None:
        chunks = self.owner.take_chunks_beyond(self._spans(tokens))
        if not chunks:
            return
        self._pending.append(_PendingRelease(self._fence(stream), chunks))

    def poll(self) -> int:
        released = 0
        kept: list[_PendingRelease] = []
        for p in self._pending:
            if p.event.query():
                self.owner.release_chunks(p.chunks)
                released += p.nbytes
            else:
                kept.append(p)
        self._pending = kept
        return released

    def close(self) -> None:
        for p in self._pending:
            p.event.synchronize()
            self.owner.release_chunks(p.chunks)
        self._pending = []


def kv_buffers(pool: Any) -> list:
    """The per-layer buffers an elastic pool grows and shrinks: an MHA pool's K and V buffers, or an MLA pool's
    latent buffers (`kv_buffer`, one per layer)."""
    if getattr(pool, "k_buffer", None) and getattr(pool, "v_buffer", None):
        return [*pool.k_buffer, *pool.v_buffer]
    if getattr(pool, "kv_buffer", None):
        return list(pool.kv_buffer)
    raise TypeError(f"KV pool {type(pool).__name__} has neither K/V buffers nor MLA latent buffers: only MHA and "
                    "MLA pools are elastic")


def host_bytes_per_token(pool: Any) -> int:
    """Bytes one token slot takes across every buffer of an MHA or MLA pool (exact, from the tensors)."""
    total = 0
    slots = pool.size + pool.page_size
    for b in kv_buffers(pool):
        nbytes = b.numel() * b.element_size()
        if nbytes % slots:
            raise TypeError(f"KV buffer of {nbytes} B is not a whole number of {slots} token slots")
        total += nbytes // slots
    return total


def make_backing(pool: Any, capacity_tokens: int, owner: Optional[Any] = None, ledger: Optional[Any] = None) -> KVBacking:
    """The VMM backing when SGLang's pool buffers sit in `owner`, else the host one. With TP > 1 `ledger` is the
    runtime's FenceLedger (runtime/fence_ledger.py): the fences the VMM backing records when it parks its tail
    are numbered and agreed by every rank (host memory is released at once: it records none)."""
    if owner is not None:
        fence = _cuda_event_fence(owner.device_id)
        return VmmKVBacking(owner, pool.page_size, ledger.wrap_event_fn(fence) if ledger is not None else None)
    return HostKVBacking(host_bytes_per_token(pool), capacity_tokens)
