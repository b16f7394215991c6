"""Elastic KV cache: SGLang's KV capacity grows and shrinks, in tokens, while the scheduler serves.

The pool and its allocator are created for `max_tokens` token slots (room for the largest KV the expert
weights could ever give up, patches/kv_cache.py does the sizing), but only `capacity_tokens` are usable: the
slots past the capacity are *parked*, i.e. absent from the allocator's free list, so SGLang never hands
them out. Slot ids are the allocator's units: token slots with page size 1, pages otherwise (slot/page 0 is
SGLang's padding slot and is never part of the free list).

- `grow(nbytes)` adds parked slots back to the free list, lowest ids first, as many as `nbytes` (plus the
  credit left by earlier grows) can back; on CUDA the backing maps the chunks first.
- `shrink(nbytes)` parks slots from the tail `[new_cap, cap)`: only free slots can go. It first evicts
  radix-cache leaves that hold tail slots (nothing a request holds is ever evicted); when a running
  request holds a tail slot, the shrink stops above it (deferred: it returns what was possible).

Every change is published to everything in SGLang that holds a copy of the capacity, so its own memory
checks (`SchedulerInvariantChecker`, the idle leak check, `check_decode_mem`) keep balancing:
`available + evictable + protected == max_total_num_tokens` with parked slots in none of the terms.

Streams: the free-list edits (`grow`'s new ids, a shrink's parking) are tensor ops SGLang's scheduler reads on
its own stream (the schedule stream of 0.5.17's event loops: the alloc of the next batch and its req_to_token
writes run there). They run on `allocator_stream`, which the serving loop sets to the stream current when the
scheduler calls it; enqueued on the forward stream instead (where the pager's boundary runs), the scheduler
would read the new free list before the running forward let it be written (garbage slot ids, an illegal
memory access in the next forward). The fence that unmaps a parked tail is recorded on `stream`, the forward
stream: no forward still in flight may read the chunks it releases.

Hybrid sliding-window pools (SWAKVPool with SWATokenToKVPoolAllocator: Gemma-2/3/4 and the like): `pool` is the
full-attention sub-pool and only its allocator (`units`) grows and shrinks; the sliding-window sub-pool keeps the
size SGLang gave it. A sliding-window layer needs at most its window of each running request, so the SWA pool
bounds how many requests run at once, not how long their contexts get; the full pool bounds the context, and it
is what the weights' freed bytes buy. The composite allocator's full size and the scheduler's
`full_tokens_per_layer` copies follow every change, and tail eviction goes through the radix cache's own
eviction (UnifiedRadixCache, what SGLang builds for these models, or SWARadixCache).

`controller.ElasticKV` is implemented by `shrink`; the pager's `on_bytes_freed` is `grow`. With a budget
attached (`attach_budget`) grows reserve and commit "kv" bytes and releases give them back, in the
backing's bytes (physical and chunk-rounded on CUDA, `tokens * bytes_per_token` on CPU).

With TP > 1 every rank runs the same grow/shrink at the same iteration; the outcome is deterministic in
the allocator and radix state, which all ranks share because they schedule the same batches.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from pagedweight.kvcache.elastic_kv_backing import KVBacking, host_bytes_per_token

logger = logging.getLogger("pagedweight")


@dataclass
class ElasticKVCounters:
    grows: int = 0
    shrinks: int = 0
    tokens_grown: int = 0
    tokens_shrunk: int = 0
    bytes_grown: int = 0
    bytes_released: int = 0
    evicted_tokens: int = 0
    deferred_shrinks: int = 0  # a shrink stopped early: running requests (or locked cache) hold the tail
    refused_grows: int = 0  # the budget or the driver refused the memory


@dataclass(frozen=True)
class ElasticKVState:
    capacity_tokens: int
    max_tokens: int
    min_tokens: int
    bytes_per_token: int
    parked_tokens: int
    page_size: int
    mapped_bytes: int
    credit_bytes: int
    available_tokens: int
    counters: ElasticKVCounters


class ElasticKVCache:
    """Grow/shrink the usable part of one SGLang MHA or MLA KV pool and its (token or paged) allocator, or the
    full-attention part of a hybrid sliding-window pool (`pool` is then its full sub-pool, `allocator` SGLang's
    SWATokenToKVPoolAllocator and `units` the full-attention allocator inside it)."""

    def __init__(
        self,
        pool: Any,
        allocator: Any,
        *,
        capacity_tokens: int,
        max_tokens: int,
        backing: KVBacking,
        min_tokens: Optional[int] = None,
    ) -> None:
        self.pool = pool
        self.allocator = allocator  # what the scheduler holds (the composite one for a hybrid SWA pool)
        self.units = _units_allocator(allocator)  # whose free lists hold the elastic slots
        self.page_size = int(allocator.page_size)
        self.bytes_per_token = host_bytes_per_token(pool)
        self.backing = backing
        self.counters = ElasticKVCounters()
        self.scheduler: Any = None
        self.model_runner: Any = None
        self.tree_cache: Any = None
        self.budget: Any = None
        self.stream: Any = None  # where shrink fences are recorded (the forward stream on CUDA)
        self.allocator_stream: Any = None  # where the free-list edits run (the scheduler's stream; None: current)
        self._credit = 0
        self._check_supported()
        self._set_limits(capacity_tokens, max_tokens, min_tokens)
        self._park_initial()

    # -- set-up --------------------------------------------------------------------------------------

    def _check_supported(self) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        plain = (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)
        if type(self.units) not in plain:
            raise TypeError(
                f"elastic KV cache supports SGLang's TokenToKVPoolAllocator and PagedTokenToKVPoolAllocator (alone or "
                f"as the full-attention part of SWATokenToKVPoolAllocator); this server uses "
                f"{type(self.allocator).__name__} (Mamba, HiSparse and out-of-tree allocators are not elastic)"
            )
        if self.units.get_kvcache() is not self.pool:
            raise ValueError("the allocator does not manage this KV pool")

    def _set_limits(self, capacity: int, max_tokens: int, min_tokens: Optional[int]) -> None:
        ps = self.page_size
        pool_slots = int(self.pool.size)
        if max_tokens % ps or capacity % ps:
            raise ValueError(f"capacity {capacity} and max_tokens {max_tokens} must be multiples of page_size {ps}")
        if not 0 < capacity <= max_tokens <= pool_slots:
            raise ValueError(
                f"need 0 < capacity ({capacity}) <= max_tokens ({max_tokens}) <= the pool's slots ({pool_slots})"
            )
        min_tokens = capacity if min_tokens is None else min_tokens
        if not ps <= min_tokens <= capacity or min_tokens % ps:
            raise ValueError(f"min_tokens {min_tokens} must be a page multiple in [{ps}, {capacity}]")
        self._cap_units = capacity // ps
        self._max_units = max_tokens // ps
        self._min_units = min_tokens // ps

    def _park_initial(self) -> None:
        """The allocator was created for max_tokens: take everything past the capacity off its lists."""
        if self.units.size != self._max_units * self.page_size:
            raise ValueError(
                f"allocator has {self.units.size} tokens, expected max_tokens {self._max_units * self.page_size}"
            )
        if self.units.available_size() != self.units.size:
            raise RuntimeError("the elastic KV cache must be set up on an empty allocator")
        self._drop_from_free_lists(self._cap_units)
        self._publish()

    def rebase(self, capacity_tokens: int) -> None:
        """SGLang resized the (still empty) pool itself: CUDA post-capture KV sizing backed the final span
        (`finalize_backing`) and `allocator.resize` cleared the allocator to `capacity_tokens` slots. The
        elastic range keeps `max_tokens`; the pool's slots still exist up to it (the VA is reserved)."""
        ps = self.page_size
        cap = capacity_tokens - capacity_tokens % ps
        if not 0 < cap <= self.max_tokens:
            raise ValueError(f"post-capture capacity {capacity_tokens} outside (0, {self.max_tokens}]")
        if self.units.available_size() != self.units.size:
            raise RuntimeError("rebase needs an empty allocator")
        self.pool.size = self.max_tokens
        self._cap_units = cap // ps
        self._min_units = min(self._min_units, self._cap_units)
        self._drop_from_free_lists(self._cap_units)
        self._publish()

    def bind_scheduler(self, scheduler: Any) -> None:
        """Follow the scheduler's radix cache and keep its copies of the capacity in step."""
        if getattr(scheduler.server_args, "dcp_size", 1) != 1:
            raise ValueError("elastic KV cache does not support decode context parallelism (dcp_size > 1)")
        if scheduler.token_to_kv_pool_allocator is not self.allocator:
            raise ValueError("the scheduler serves a different KV allocator than this elastic KV cache")
        self.scheduler = scheduler
        self.tree_cache = getattr(scheduler, "tree_cache", None)
        self.stream = getattr(scheduler, "forward_stream", None) if torch.cuda.is_available() else None
        self._publish()

    def bind_model_runner(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        self._publish()

    def attach_budget(self, budget: Any) -> None:
        """Grows reserve+commit "kv" bytes in `budget`, releases give them back. The bytes already backed
        at attach time (`state().mapped_bytes`) are the caller's to account (e.g. budget capacity)."""
        self.budget = budget

    # -- the numbers ------------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self._cap_units * self.page_size

    @property
    def max_tokens(self) -> int:
        return self._max_units * self.page_size

    @property
    def min_tokens(self) -> int:
        return self._min_units * self.page_size

    @property
    def parked_tokens(self) -> int:
        return self.max_tokens - self.capacity_tokens

    def state(self) -> ElasticKVState:
        return ElasticKVState(
            capacity_tokens=self.capacity_tokens,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            bytes_per_token=self.bytes_per_token,
            parked_tokens=self.parked_tokens,
            page_size=self.page_size,
            mapped_bytes=self.backing.mapped_bytes(),
            credit_bytes=self._credit,
            available_tokens=int(self.units.available_size()),
            counters=ElasticKVCounters(**asdict(self.counters)),
        )

    def state_dict(self) -> dict:
        return asdict(self.state())

    # -- grow ---------------------------------------------------------------------------------------------

    def grow(self, nbytes: int) -> int:
        """`nbytes` more memory may back KV: add as many parked slots as it (plus earlier credit) backs.
        Returns the tokens added. Bytes that back no whole slot (or chunk) stay as credit for the next grow."""
        if nbytes < 0:
            raise ValueError(f"grow by a negative byte count ({nbytes})")
        self.poll()
        self._credit += nbytes
        if self.budget is not None:
            self._credit = min(self._credit, self.budget.free)  # free bytes someone else took are gone
        units = self._units_for_credit(self._credit)
        with self._on_allocator_stream():
            added = self._grow_units(units)
        return added * self.page_size

    def grow_tokens(self, tokens: int) -> int:
        """Add up to `tokens` parked slots regardless of credit (budget still applies). Returns tokens added."""
        if tokens < 0:
            raise ValueError(f"grow by a negative token count ({tokens})")
        self.poll()
        target = min(self._max_units, self._cap_units + tokens // self.page_size)
        with self._on_allocator_stream():
            return self._grow_units(target) * self.page_size

    def _units_for_credit(self, credit: int) -> int:
        """The largest capacity (units) whose extra backing fits in `credit` bytes."""
        ps = self.page_size
        lo, hi = self._cap_units, self._max_units
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.backing.bytes_to_grow(mid * ps) <= credit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _grow_units(self, target_units: int) -> int:
        if target_units <= self._cap_units:
            return 0
        ps = self.page_size
        need = self.backing.bytes_to_grow(target_units * ps)
        reservation = None
        if self.budget is not None and need:
            reservation = self.budget.try_reserve("kv", need)
            if reservation is None:
                self.counters.refused_grows += 1
                return 0
        try:
            self.backing.grow_to(target_units * ps)
        except Exception as e:  # driver refused (out of memory): defer, never crash the scheduler
            if reservation is not None:
                self.budget.cancel(reservation)
            self.counters.refused_grows += 1
            logger.error("elastic KV: backing %d tokens failed (%s); capacity stays %d", target_units * ps, e, self.capacity_tokens)
            return 0
        if reservation is not None:
            self.budget.commit(reservation)
        self._credit = max(0, self._credit - need)
        old = self._cap_units
        new_ids = torch.arange(old + 1, target_units + 1, dtype=torch.int64, device=self.units.device)
        # Append: SGLang allocates from the front, so the new high ids are used last (easier to park again).
        self.units.free_pages = torch.cat((self.units.free_pages, new_ids))
        self._cap_units = target_units
        added = target_units - old
        self.counters.grows += 1
        self.counters.tokens_grown += added * ps
        self.counters.bytes_grown += need
        self._publish()
        logger.info("elastic KV: grew %d -> %d tokens (+%d B)", old * ps, target_units * ps, need)
        return added

    # -- shrink -------------------------------------------------------------------------------------------

    def shrink(self, nbytes: int) -> int:
        """Give back up to `nbytes` of KV memory from the tail; only free slots go. Returns the bytes
        released now (on CUDA, chunks whose fence is not done yet are released by a later `poll`)."""
        if nbytes < 0:
            raise ValueError(f"shrink by a negative byte count ({nbytes})")
        released = self.poll()
        if nbytes <= 0:
            return released
        target = self._units_for_release(self.backing.mapped_bytes() - nbytes)
        with self._on_allocator_stream():
            self._shrink_to_units(target)
        return released + self._release_polled()

    def shrink_tokens(self, tokens: int) -> int:
        """Park up to `tokens` tail slots. Returns the tokens parked."""
        if tokens < 0:
            raise ValueError(f"shrink by a negative token count ({tokens})")
        self._release_polled()
        before = self._cap_units
        with self._on_allocator_stream():
            self._shrink_to_units(max(self._min_units, self._cap_units - tokens // self.page_size))
        self._release_polled()
        return (before - self._cap_units) * self.page_size

    def resize_to(self, tokens: int) -> int:
        """Move the capacity toward `tokens` (within [min_tokens, max_tokens]); returns the new capacity."""
        if tokens >= self.capacity_tokens:
            self.grow_tokens(tokens - self.capacity_tokens)
        else:
            self.shrink_tokens(self.capacity_tokens - tokens)
        return self.capacity_tokens

    def _units_for_release(self, keep_bytes: int) -> int:
        """The smallest capacity (units, >= min) whose backing is still >= keep_bytes: shrinking to it
        releases at most the requested bytes."""
        ps = self.page_size
        lo, hi = self._min_units, self._cap_units
        while lo < hi:
            mid = (lo + hi) // 2
            if self.backing.bytes_at(mid * ps) >= keep_bytes:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _shrink_to_units(self, target: int) -> None:
        target = max(target, self._min_units)
        if target >= self._cap_units:
            return
        if not self.allocator.is_not_in_free_group:
            self.counters.deferred_shrinks += 1  # a free group is open: its frees are not in the lists yet
            return
        highest = self._highest_used_unit(target)
        if highest > target and self.tree_cache is not None:
            self.counters.evicted_tokens += evict_tail(self.tree_cache, target, self.page_size, self._highest_used_unit,
                                                       self._used_units_above)
            highest = self._highest_used_unit(target)
        new_units = max(target, highest)
        if new_units > target:
            self.counters.deferred_shrinks += 1
        # On CUDA keep every slot whose chunk stays mapped anyway: parking it would free nothing.
        new_units = self.backing.round_up(new_units * self.page_size, self.capacity_tokens) // self.page_size
        if new_units >= self._cap_units:
            return
        old = self._cap_units
        self._drop_from_free_lists(new_units)
        self._cap_units = new_units
        self.backing.shrink_to(new_units * self.page_size, self.stream)
        self.counters.shrinks += 1
        self.counters.tokens_shrunk += (old - new_units) * self.page_size
        self._publish()
        logger.info("elastic KV: shrank %d -> %d tokens", old * self.page_size, new_units * self.page_size)

    def _highest_used_unit(self, above: int) -> int:
        """The highest unit id in (above, cap] that is not free, or `above` when all of them are free."""
        n = self._cap_units - above
        if n <= 0:
            return above
        free = self._free_ids()
        free = free[free > above] - (above + 1)
        is_free = torch.zeros(n, dtype=torch.bool)
        is_free[free.cpu()] = True
        used = torch.nonzero(~is_free)
        return above if used.numel() == 0 else above + 1 + int(used.max())

    def _used_units_above(self, above: int) -> int:
        """How many unit ids in (above, cap] are not free (held by requests or the radix cache)."""
        n = self._cap_units - above
        if n <= 0:
            return 0
        return n - int((self._free_ids() > above).sum())

    def _free_ids(self) -> torch.Tensor:
        a = self.units
        return torch.cat((a.free_pages, a.release_pages)) if len(a.release_pages) else a.free_pages

    def _drop_from_free_lists(self, keep_units: int) -> None:
        a = self.units
        a.free_pages = a.free_pages[a.free_pages <= keep_units]
        a.release_pages = a.release_pages[a.release_pages <= keep_units]

    def _on_allocator_stream(self):
        """The scheduler's stream for the free-list edits (module docstring: Streams)."""
        return torch.cuda.stream(self.allocator_stream) if self.allocator_stream is not None else nullcontext()

    # -- release of physical memory -------------------------------------------------------------------------

    def poll(self) -> int:
        """Release backing whose fence is done (call once per scheduler iteration on CUDA)."""
        return self._release_polled()

    def _release_polled(self) -> int:
        released = self.backing.poll()
        if released:
            self.counters.bytes_released += released
            if self.budget is not None:
                self.budget.release("kv", released)
        return released

    # -- keeping SGLang in step -------------------------------------------------------------------------

    def _publish(self) -> None:
        cap = self.capacity_tokens
        a = self.units
        a.size = cap
        if self.page_size > 1:
            a.num_pages = self._cap_units
        swa = self.allocator is not a  # a hybrid sliding-window pool: its full-attention part is what changes
        if swa:
            self.allocator._size_full = cap
        mr = self.model_runner
        if mr is not None:
            mr.max_total_num_tokens = cap
            config = getattr(mr, "memory_pool_config", None)
            if config is not None:
                config.max_total_num_tokens = cap
            if swa:
                mr.full_max_total_num_tokens = cap
                if config is not None:
                    config.full_max_total_num_tokens = cap
        s = self.scheduler
        if s is not None:
            s.max_total_num_tokens = cap
            if swa:
                s.full_tokens_per_layer = cap
            for name in ("invariant_checker", "pool_stats_observer", "kv_events_publisher", "load_inquirer"):
                obj = getattr(s, name, None)
                if obj is None:
                    continue
                if hasattr(obj, "max_total_num_tokens"):
                    _set_field(obj, "max_total_num_tokens", cap)
                if swa and hasattr(obj, "full_tokens_per_layer"):
                    _set_field(obj, "full_tokens_per_layer", cap)


def _units_allocator(allocator: Any) -> Any:
    """The allocator whose free lists hold the elastic slots: the full-attention one inside SGLang's hybrid
    sliding-window allocator, else the allocator itself."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    if type(allocator) is SWATokenToKVPoolAllocator:
        full = allocator.full_attn_allocator
        if full is allocator.swa_attn_allocator:
            raise TypeError("elastic KV cache: an all-sliding-window pool has no full-attention part to grow")
        return full
    return allocator


def _set_field(obj: Any, name: str, value: Any) -> None:
    try:
        setattr(obj, name, value)
    except (AttributeError, TypeError):  # frozen dataclass (SchedulerPoolStatsObserver)
        object.__setattr__(obj, name, value)


def evict_tail(tree_cache: Any, keep_units: int, page_size: int, highest_used: Any = None,
               used_above: Any = None) -> int:
    """Evict radix-cache nodes that hold slots past `keep_units` and that no request holds. Returns the
    tokens evicted. RadixCache: first leaves (their parents follow when they become tail-holding leaves); then,
    for a tail-holding inner node with lock_ref == 0, its whole subtree (a lock on any node is counted on all
    its ancestors, so lock_ref == 0 means no request holds anything below). Nodes that hold only low
    slots are kept unless they sit below such an inner node. SWARadixCache: `evict_swa_tail`. UnifiedRadixCache
    (SGLang's tree for hybrid sliding-window models): `evict_unified_tail`."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if getattr(tree_cache, "disable", False):
        return 0
    if type(tree_cache) is SWARadixCache:
        return evict_swa_tail(tree_cache, keep_units, page_size, highest_used)
    if type(tree_cache) is UnifiedRadixCache and used_above is not None:
        return evict_unified_tail(tree_cache, keep_units, page_size, used_above)
    if not hasattr(tree_cache, "evictable_leaves"):
        return 0
    if type(tree_cache) is not RadixCache:
        logger.warning("elastic KV: tail eviction supports RadixCache, SWARadixCache and UnifiedRadixCache, not %s; "
                       "deferring",
                       type(tree_cache).__name__)
        return 0

    def holds_tail(node) -> bool:
        v = node.value
        return v is not None and len(v) > 0 and bool(((v // page_size) > keep_units).any())

    def evict_leaf(node) -> int:
        tree_cache.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        n = len(node.value)
        tree_cache._delete_leaf(node)
        tree_cache._record_remove_event(node)
        return n

    evicted = 0
    stack = [n for n in list(tree_cache.evictable_leaves) if holds_tail(n)]
    while stack:
        node = stack.pop()
        if node not in tree_cache.evictable_leaves:
            continue
        parent = node.parent
        evicted += evict_leaf(node)
        if parent is not tree_cache.root_node and parent in tree_cache.evictable_leaves and holds_tail(parent):
            stack.append(parent)

    # Inner nodes: top-most unlocked tail holders, each with its subtree (children before parents).
    todo = list(tree_cache.root_node.children.values())
    while todo:
        node = todo.pop()
        if node.lock_ref == 0 and holds_tail(node):
            order, walk = [], [node]
            while walk:
                x = walk.pop()
                order.append(x)
                walk.extend(x.children.values())
            for x in reversed(order):  # every child comes after its parent in `order`
                evicted += evict_leaf(x)
        else:
            todo.extend(node.children.values())
    return evicted


def evict_unified_tail(tree_cache: Any, keep_units: int, page_size: int, used_above: Any) -> int:
    """UnifiedRadixCache keeps its nodes in a tree core whose walk is internal, so evict through the cache's own LRU
    eviction (it keeps every component's values, LRU lists and sizes consistent), in rounds that ask for as many
    full-attention tokens as the tail still holds (`used_above(keep_units)` units). Stops when the tail is free,
    nothing is evictable, or a round frees no tail slot (what is left there is held by running requests): one
    fruitless round at most. LRU order may take nodes below the tail first, as SGLang's own eviction under memory
    pressure would. Returns the tokens evicted."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    evicted, held = 0, used_above(keep_units)
    while held > 0:
        want = min(held * page_size, int(tree_cache.full_evictable_size()))
        if want <= 0:
            break
        evicted += int(tree_cache.evict(EvictParams(num_tokens=want)).num_tokens_evicted)
        now = used_above(keep_units)
        if now >= held:
            break
        held = now
    return evicted


def evict_swa_tail(tree_cache: Any, keep_units: int, page_size: int, highest_used: Any) -> int:
    """SWARadixCache: evict through the cache's own LRU eviction (it keeps its full and sliding-window lists,
    tombstones and sizes consistent) until no unlocked node holds a full-attention slot past `keep_units`.
    Each round asks for as many tokens as those nodes hold; LRU order may take other unlocked nodes first, as
    SGLang's own eviction under memory pressure would. Stops when the tail is free of cached slots
    (`highest_used(keep_units) == keep_units`) or a round evicts nothing. Returns the tokens evicted."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    def tail_tokens() -> int:
        total, stack = 0, list(tree_cache.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            v = node.value
            if node.full_lock_ref == 0 and v is not None and len(v) and bool(((v // page_size) > keep_units).any()):
                total += len(v)
        return total

    evicted = 0
    while highest_used is None or highest_used(keep_units) > keep_units:
        want = tail_tokens()
        if want == 0:
            break
        got = int(tree_cache.evict(EvictParams(num_tokens=want)).num_tokens_evicted)
        if got == 0:
            break
        evicted += got
    return evicted
