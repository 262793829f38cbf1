"""Continuous batching: which requests run this step, and with how many new tokens.

Invariant at the top of every ``schedule()``: each running request has at least one
token without KV (``num_uncomputed >= 1``: the rest of its prompt, or the token sampled
last step). A step hands each chosen request ``n`` of those tokens; requests whose
uncomputed tokens all get KV this step produce one new token. Chunked prefill, decode,
prefix-cache hits and re-prefill after retraction are all this one rule.

Order of a step: (1) decode tokens of running requests (retracting the newest requests
if KV runs out), (2) the rest of chunked prefills, (3) admissions from the waiting queue
under the prefill token budget, by policy: ``lpm`` (longest cached prefix first, with
requests passed over ``starvation_bound`` times served first) or ``fcfs``.

Plain Python: slots and table rows are integers from ``kv_allocator``; where a request's
tokens live goes to the device side as ``TableWrite`` records in the step's plan, and KV
moving between the device and host tiers as ``HostSave``/``HostLoad`` records.

A request whose cached prefix is partly on the host is admitted at once: its host part
gets device slots and a load, and the request takes no step until the load is done
(``waiting_load``), while the others keep stepping.
"""
from __future__ import annotations

import time

from .admission import admission_order, shares_uncached
from .config import EngineConfig
from .kv_allocator import KVSlotAllocator, TableRowAllocator
from .radix_cache import RadixCache
from .request import Req, ReqStatus
from .schedule_plan import ScheduledItem, SchedulePlan, TableWrite

# an eviction frees at least this share of the pool (1/EVICT_SHARE): the lowest-ranked
# leaves, which would soon go anyway. Each eviction has a fixed cost (it ranks again the
# candidates touched since the last one and plans the saves to the host tier as one
# batch): with a 1/256 share a multi-turn chat evicted every other step
EVICT_SHARE = 64


class Scheduler:
    def __init__(self, config: EngineConfig, slots: KVSlotAllocator, rows: TableRowAllocator,
                 cache: RadixCache, context_len: int) -> None:
        self.config = config
        self.context_len = context_len
        self.slots = slots
        self.rows = rows
        self.cache = cache
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.num_retractions = 0
        # table writes made since the last plan (admissions, cache inserts after a step)
        self._table_writes: list[TableWrite] = []

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulePlan:
        out_of_room: list[Req] = []
        items, budget = self._schedule_running(out_of_room)
        items += self._schedule_waiting(budget)
        if not self.config.enable_mixed_batch:
            decode = [i for i in items if i.num_new == 1 and i.req.output_ids]
            if len(decode) < len(items):  # a prefill step: decodes wait, slots go back
                for i in decode:
                    self._unextend(i)
                items = [i for i in items if i not in decode]
        writes = []
        if items:  # pending writes ride with the next launch
            writes, self._table_writes = self._table_writes, []
        return SchedulePlan(items, writes, out_of_room, self.cache.take_copies())

    def load_done(self, ticket: int) -> None:
        """The device side finished a host load: its nodes are usable."""
        self.cache.finish_load(ticket)

    # ------------------------------------------------------------------ running
    def _schedule_running(self, out_of_room: list[Req]) -> tuple[list[ScheduledItem], int]:
        """This step's items for running requests, and the prefill budget left."""
        # one pass sorts the running requests. It runs every step for every request, so
        # it reads each length once. A decode whose last (possibly in-flight) token
        # reaches a length limit gets no step
        decode: list[Req] = []
        partial: list[Req] = []  # prompt (or forced) tokens left to compute
        ctx = self.context_len
        for r in self.running:
            if r.waiting_load:
                if not self.cache.is_ready(r.last_node):
                    continue  # its prefix is still coming from the host
                r.waiting_load = False
            n_in, n_out = len(r.origin_input_ids), len(r.output_ids)
            left = n_in + n_out - len(r.kv_indices)
            if left == 1:
                if n_out < r.params.max_new_tokens and n_in + n_out < ctx:
                    decode.append(r)
            elif left > 1:
                partial.append(r)
        budget = self.config.max_prefill_tokens
        while decode and not self.can_fit(len(decode)):
            victim = max(decode, key=lambda r: (r.admit_time, r.rid))
            if len(self.running) == 1:
                # one request alone fills the pool: it cannot grow any further
                out_of_room.append(victim)
                return [], budget
            self.retract(victim)
            decode.remove(victim)
        items = self._extend_decodes(decode)
        for req in partial:
            if budget <= 0:
                break
            n = min(req.num_uncomputed, budget)
            if _forced_tokens(req) and not self.config.enable_jump_forward:
                n = 1  # forced text without jump-forward: one decode step per token
            if not self.can_fit(n):
                break
            items.append(self._extend(req, n))
            self._share_now(req)
            budget -= n
        return items, budget

    def retract(self, req: Req) -> None:
        """Preempt a running request: cache what it computed, free the rest, requeue it
        at the front. Its output so far is kept and re-prefilled on readmission."""
        self.release(req)
        req.status = ReqStatus.WAITING
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_retractions += 1

    # ------------------------------------------------------------------ admission
    def _schedule_waiting(self, budget: int) -> list[ScheduledItem]:
        if not self.waiting:
            return []
        items: list[ScheduledItem] = []
        admitted_arrivals: list[float] = []
        # prompts whose KV is being computed now and is not in the tree yet: chunked
        # prefills still under way (their later chunks), this step's admissions that
        # could not be shared at once (_share_now), and (overlap) such prefills launched
        # but not yet read, whose prompt goes into the tree when their step is processed
        admitted_prompts = [r.fill_ids if r.num_uncomputed > 1 else r.origin_input_ids
                            for r in self.running
                            if r.num_uncomputed > 1 or not _prompt_cached(r)]
        # tokens the running requests may still decode, kept up to date as requests are
        # admitted (summing it again for each admission made a burst's step quadratic)
        decode_left = sum(r.params.max_new_tokens - len(r.output_ids) for r in self.running)
        for req in admission_order(self.waiting, self.cache, self.config):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.grammar_future is not None:
                continue  # its grammar is still compiling: others go ahead
            if req.blocked_by is not None:
                if not _prompt_cached(req.blocked_by):
                    continue
                req.blocked_by = None
            if not self.rows.can_alloc():
                break
            match = self.cache.match_prefix(req.fill_ids[:req.max_match_len()])
            cached = len(match.kv_indices) + match.host_len
            if self.cache.enabled and shares_uncached(req.fill_ids, cached, admitted_prompts):
                continue
            self.cache.lock(match.deepest)
            n = min(len(req.fill_ids) - cached, budget)
            # loaded tokens need slots but no compute: they do not count against the budget
            if not self._can_admit(n + match.host_len, decode_left):
                self.cache.unlock(match.deepest)
                break  # head of line waits: skipping it would let small requests starve it
            self._admit(req, match)
            decode_left += req.params.max_new_tokens - len(req.output_ids)
            admitted_arrivals.append(req.arrival)
            if req.waiting_load:
                admitted_prompts.append(req.fill_ids)
                continue  # it steps once its load is done
            items.append(self._extend(req, n))
            budget -= n
            if not self._share_now(req) or req.num_uncomputed > 0:
                admitted_prompts.append(req.fill_ids)  # not all of it in the tree yet
        if admitted_arrivals:
            latest = max(admitted_arrivals)
            for req in self.waiting:
                if req.arrival < latest:
                    req.times_passed_over += 1
        return items

    def _can_admit(self, n: int, decode_left: int) -> bool:
        """Whether ``n`` new tokens fit beside a share of the ``decode_left`` tokens the
        running requests may still decode (a check: nothing is evicted or taken here)."""
        if not self.running:
            return self.can_fit(n)
        # keep room for running requests to decode, so admissions do not force retractions
        reserve = min(int(self.config.new_token_ratio * decode_left), self.slots.size // 2)
        return self.can_fit(n + reserve)

    def _admit(self, req: Req, match) -> None:
        """Take the request in with its cached prefix (locked by the caller); a host part
        gets device slots now and is loaded before the request steps."""
        kv = list(match.kv_indices)
        if match.host_len:
            slots = self.take_slots(match.host_len)
            self.cache.start_load(match, slots)
            kv += slots
        node = match.deepest
        self.cache.record_use(node)
        req.kv_indices = kv
        req.tree_owned_len = len(kv)
        req.last_node = node
        req.waiting_load = not self.cache.is_ready(node)
        req.req_pool_idx = self.rows.alloc()
        self._table_writes.append(TableWrite(req.req_pool_idx, 0, list(kv)))
        if not req.admitted_once:
            req.num_cached_tokens = req.tree_owned_len
            req.num_host_cached_tokens = match.host_len
            req.admitted_once = True
        req.admit_time = time.monotonic()
        if req.first_admit_time is None:
            req.first_admit_time = req.admit_time
        req.status = ReqStatus.RUNNING
        self.waiting.remove(req)
        self.running.append(req)

    # ------------------------------------------------------------------ KV helpers
    def can_fit(self, n: int) -> bool:
        """Whether ``n`` slots are free or can be freed by evicting (every unlocked tree
        node can: a lock pins its whole path to the root). A check only."""
        return self.slots.available_size() + self.cache.evictable_size >= n

    def take_slots(self, n: int) -> list[int]:
        """``n`` slots, evicting first what is short; the caller checked ``can_fit``."""
        short = n - self.slots.available_size()
        if short > 0:
            # an eviction has a fixed cost: once the pool is full of cache, evicting just
            # what one step needs would pay it every step
            self.cache.evict(max(short, self.slots.size // EVICT_SHARE))
        return self.slots.alloc(n)

    def _extend(self, req: Req, n: int) -> ScheduledItem:
        slots = self.take_slots(n)
        start = req.num_computed
        req.kv_indices.extend(slots)
        return ScheduledItem(req, n, start, slots, samples=req.num_uncomputed == 0)

    def _extend_decodes(self, reqs: list[Req]) -> list[ScheduledItem]:
        """``_extend(r, 1)`` for each request, with one allocation for all of them."""
        if not reqs:
            return []
        slots = self.take_slots(len(reqs))
        items = []
        add = items.append
        for req, slot in zip(reqs, slots):
            kv = req.kv_indices
            add(ScheduledItem(req, 1, len(kv), [slot], True))
            kv.append(slot)
        return items

    def _unextend(self, item: ScheduledItem) -> None:
        del item.req.kv_indices[item.start_pos:]
        self.slots.free(item.new_slots)

    # ------------------------------------------------------------------ completion
    def _share_now(self, req: Req) -> bool:
        """Put the prompt tokens this step computes for ``req`` into the tree before the
        step runs, so that the requests admitted after it, in this very step too, take
        them as a cached prefix: few-shot questions sent with their shared examples then
        compute the examples once in one step, instead of waiting a step (two with
        overlap) for them. Safe because a step is one forward on one stream, which stores
        every new token's K/V before any attention reads the pool, and later steps run
        after it. Only when the tree takes every new slot (it holds nothing of these
        tokens past what ``req`` owns): duplicates are left to ``cache_unfinished`` after
        the step, when freeing a slot can no longer race with this step's writes."""
        owned, end = req.tree_owned_len, req.num_computed
        if not self.cache.enabled or end <= owned:
            return False
        tokens = req.fill_ids[:end]
        if min(tokens[owned:]) < 0 or self.cache.device_prefix_len(tokens) != owned:
            return False  # a placeholder (a token still on the device), or a duplicate
        present = self.cache.insert(tokens, req.kv_indices)
        assert present == owned, (present, owned)
        self._hold_path(req, tokens)
        return True

    def _hold_path(self, req: Req, tokens: list[int]) -> list[int]:
        """Pin the tree's path of ``tokens`` (all in the tree) for ``req`` instead of the
        one it held; returns the path's slots."""
        match = self.cache.match_prefix(tokens)
        assert len(match.kv_indices) == len(tokens)
        self.cache.lock(match.last_node)
        self.cache.unlock(req.last_node)
        req.last_node, req.tree_owned_len = match.last_node, len(tokens)
        return match.kv_indices

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk: put the computed tokens into the tree and take the
        tree's slots, so the next requests (and the next chunk) share them. Nothing to
        do when ``_share_now`` put them there before the step."""
        if (not self.cache.enabled or req.status is not ReqStatus.RUNNING
                or req.tree_owned_len >= req.num_computed):
            return
        tokens = req.fill_ids[:req.num_computed]
        owned = req.tree_owned_len
        present = self.cache.insert(tokens, req.kv_indices)
        self.slots.free(req.kv_indices[owned:present])
        slots = self._hold_path(req, tokens)
        if present > owned:  # another request inserted these first: use its slots
            self._table_writes.append(TableWrite(req.req_pool_idx, owned, slots[owned:present]))
        req.kv_indices = list(slots)

    def release(self, req: Req) -> None:
        """Give back a request's KV: computed tokens go into the tree (or are freed when
        the cache is off), the tree path is unpinned, the table row is returned."""
        if req.last_node is None:
            return
        tokens = req.fill_ids[:req.num_computed]
        present = self.cache.insert(tokens, req.kv_indices)
        self.slots.free(req.kv_indices[req.tree_owned_len:present])
        self.cache.unlock(req.last_node)
        self.rows.free(req.req_pool_idx)
        req.kv_indices, req.last_node, req.tree_owned_len, req.req_pool_idx = [], None, 0, None

    def finish(self, req: Req) -> None:
        if req.status is ReqStatus.RUNNING:
            self.release(req)
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    def owned_slots(self) -> list[int]:
        """Slots held by running requests and not (yet) by the tree."""
        return [s for r in self.running for s in r.kv_indices[r.tree_owned_len:]]


def _forced_tokens(req: Req) -> bool:
    """Its uncomputed tokens are grammar-forced output appended by a jump, not prompt."""
    return req.grammar is not None and req.num_computed >= len(req.origin_input_ids)


def _prompt_cached(req: Req) -> bool:
    """The request's prompt KV is in the tree (computed in an earlier step, then cached)."""
    return req.finished or req.tree_owned_len >= len(req.origin_input_ids)
