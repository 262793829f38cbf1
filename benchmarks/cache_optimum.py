"""The offline optimum of a prefix cache: farthest-in-future eviction at token granularity.

The model (the same one ``cache_replay.py`` drives the real cache with):

* Requests are served one at a time, in trace order. Request r has a prompt P and an
  output O; its *path* is ``P + O[:-1]`` (the last sampled token never gets KV).
* The cache holds a set of tokens, each identified by the whole prefix it ends, closed
  under prefixes (a token is cached only with every token before it): a tree. At most
  ``capacity`` tokens.
* Serving r: the hit is the number of tokens of ``P[:-1]`` already cached (the last prompt
  token is always computed: its logits give the first output token). Then every token of
  r's path must be in the cache at once (the request's KV lives in the same pool), so
  other tokens are evicted to make room; r's tokens may be evicted as soon as it is done.

Optimum: evict the cached token whose next *use* is farthest away, never-used-again
first. A use is the next request whose path holds the token, if the token lies in that
request's ``P[:-1]``; if it lies beyond (the request's last prompt token or its output),
that request writes the token again for free, so keeping it until then is worth nothing
and it counts as never used (the write-without-fetch case of paging). Tokens are
unit-size pages and every policy must hold the current request's tokens, so this is
Belady's farthest-in-future rule. Prefix closure only lets leaves of the cached tree go;
the rule picks the leaf used farthest ahead, and an inner token is worth at least as
much as its most valuable cached descendant, whose hit needs it. The exchange argument
is not redone here: ``tests/test_cache_replay.py`` checks the result against an
exhaustive search over every eviction choice on small random traces.

With a host tier of H tokens besides a device tier of C, any set of C + H cached tokens
that contains the current path can be held by the two tiers together, so the optimum of
tokens served from either tier is this optimum at capacity C + H.

Implementation: the paths of the whole trace are cut into *segments*, maximal runs of
tokens used by exactly the same requests (a trie of every path, also cut at each
request's ``P[:-1]`` end). All tokens of a segment share their next use, so the cache
state is how many leading tokens of each segment are held; eviction trims the tail of the
cached leaf segment used farthest ahead.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

NEVER = float("inf")


@dataclass
class TraceRequest:
    prompt: list[int]
    output: list[int]

    @property
    def path(self) -> list[int]:
        return self.prompt + self.output[:-1]

    @property
    def hit_limit(self) -> int:
        """How much of the path may be served from the cache."""
        return max(len(self.prompt) - 1, 0)


@dataclass
class _Seg:
    tokens: list[int]
    parent: int  # -1: the root
    depth: int
    children: dict[int, int] = field(default_factory=dict)  # first token -> segment


class _Segments:
    """Every path of the trace in one trie, cut wherever any request's use differs."""

    def __init__(self) -> None:
        self.segs: list[_Seg] = []
        self.root_children: dict[int, int] = {}

    def _children(self, seg: int) -> dict[int, int]:
        return self.root_children if seg < 0 else self.segs[seg].children

    def add(self, path: list[int], cut: int) -> None:
        """Insert ``path`` and make sure a segment ends at ``cut`` and at its end."""
        node, i = -1, 0
        while i < len(path):
            kids = self._children(node)
            child = kids.get(path[i])
            if child is None:
                self._new(node, path[i:], i)
                break
            seg = self.segs[child]
            n = 0
            while n < len(seg.tokens) and i + n < len(path) and seg.tokens[n] == path[i + n]:
                n += 1
            if n < len(seg.tokens):
                self._split(child, n)
            node, i = child, i + n
        for at in (cut, len(path)):
            self._cut(path, at)

    def _new(self, parent: int, tokens: list[int], depth: int) -> int:
        self.segs.append(_Seg(list(tokens), parent, depth))
        self._children(parent)[tokens[0]] = len(self.segs) - 1
        return len(self.segs) - 1

    def _split(self, idx: int, n: int) -> None:
        """Keep the first ``n`` tokens in ``idx``; the rest becomes its only child (so
        ids of segments already walked stay valid as prefixes)."""
        seg = self.segs[idx]
        lower = _Seg(seg.tokens[n:], idx, seg.depth + n, seg.children)
        self.segs.append(lower)
        low = len(self.segs) - 1
        for child in lower.children.values():
            self.segs[child].parent = low
        seg.tokens, seg.children = seg.tokens[:n], {lower.tokens[0]: low}

    def _cut(self, path: list[int], at: int) -> None:
        node, i = -1, 0
        while i < at:
            child = self._children(node)[path[i]]
            seg = self.segs[child]
            if i + len(seg.tokens) > at:
                self._split(child, at - i)
                return
            node, i = child, i + len(seg.tokens)

    def walk(self, path: list[int]) -> list[int]:
        """The segments that make up ``path`` (after every ``add``)."""
        out, node, i = [], -1, 0
        while i < len(path):
            child = self._children(node)[path[i]]
            out.append(child)
            i += len(self.segs[child].tokens)
            node = child
        assert i == len(path)
        return out


class Optimum:
    """Farthest-in-future replay of a trace; ``hits[r]`` is request r's cached tokens."""

    def __init__(self, trace: list[TraceRequest], capacity: int,
                 prefix_closed: bool = True) -> None:
        self.trace = trace
        self.capacity = capacity
        self.prefix_closed = prefix_closed
        index = _Segments()
        for r in trace:
            index.add(r.path, r.hit_limit)
        self.segs = index.segs
        self.paths = [index.walk(r.path) for r in trace]
        # every request whose path holds a segment, and whether it may hit it there (the
        # segments inside P[:-1]); ``eligible[t]`` counts request t's hit-able segments
        self.occurs: list[list[int]] = [[] for _ in self.segs]
        self.hit_able: list[set[int]] = [set() for _ in self.segs]
        self.eligible: list[int] = []
        for t, (r, path) in enumerate(zip(trace, self.paths)):
            k = depth = 0
            while k < len(path) and depth + len(self.segs[path[k]].tokens) <= r.hit_limit:
                depth += len(self.segs[path[k]].tokens)
                self.hit_able[path[k]].add(t)
                k += 1
            self.eligible.append(k)
            for s in path:
                self.occurs[s].append(t)

    def next_use(self, seg: int, t: int) -> float:
        """When keeping ``seg`` next pays: the next request whose path holds it, if that
        request may hit it. If it may not (the segment is its last prompt token or output)
        that request writes the segment again anyway, so keeping it until then is worth
        nothing: the same as never being used."""
        occurs = self.occurs[seg]
        i = bisect.bisect_right(occurs, t)
        if i < len(occurs) and occurs[i] in self.hit_able[seg]:
            return occurs[i]
        return NEVER

    def run(self) -> list[int]:
        segs = self.segs
        cached = [0] * len(segs)
        cached_kids = [0] * len(segs)
        heap: list[tuple[float, int, int]] = []  # (-next use, -depth, seg)
        used = 0
        hits: list[int] = []
        for t, path in enumerate(self.paths):
            hit = 0
            for k in range(self.eligible[t]):
                s = path[k]
                hit += cached[s]
                if self.prefix_closed and cached[s] < len(segs[s].tokens):
                    break
            hits.append(hit)
            need = sum(len(segs[s].tokens) - cached[s] for s in path)
            if need > self.capacity - used:
                used -= self._evict(need - (self.capacity - used), set(path), t, cached,
                                    cached_kids, heap)
            for s in path:
                if cached[s] == 0 and segs[s].parent >= 0 and self.prefix_closed:
                    cached_kids[segs[s].parent] += 1
                used += len(segs[s].tokens) - cached[s]
                cached[s] = len(segs[s].tokens)
            # closed: only the path's leaf may go (its other segments have a cached child
            # on the path); relaxed: any of them
            for s in (path[-1:] if self.prefix_closed else path):
                if cached_kids[s] == 0:
                    heapq.heappush(heap, (-self.next_use(s, t), -segs[s].depth, s))
        return hits

    def _evict(self, amount: int, pinned: set[int], t: int, cached, cached_kids, heap) -> int:
        segs = self.segs
        freed = 0
        while freed < amount:
            if not heap:
                raise ValueError(f"request {t} does not fit in {self.capacity} tokens")
            neg_next, neg_depth, s = heapq.heappop(heap)
            if s in pinned:
                continue  # pushed again, with its next use, once the request is done
            if cached[s] == 0 or cached_kids[s] or -neg_next != self.next_use(s, t):
                continue  # stale: evicted, no longer a leaf, or its next use moved
            k = min(cached[s], amount - freed)
            cached[s] -= k
            freed += k
            if cached[s]:
                heapq.heappush(heap, (neg_next, neg_depth, s))
                continue
            parent = segs[s].parent
            if parent >= 0 and self.prefix_closed:
                cached_kids[parent] -= 1
                if cached_kids[parent] == 0 and parent not in pinned:
                    heapq.heappush(heap, (-self.next_use(parent, t), -segs[parent].depth,
                                          parent))
        return freed


def optimal_hits(trace: list[TraceRequest], capacity: int) -> list[int]:
    """Tokens the farthest-in-future schedule serves from the cache, per request: a
    schedule any cache could follow, so at most the optimum."""
    return Optimum(trace, capacity).run()


def hit_upper_bound(trace: list[TraceRequest], capacity: int) -> list[int]:
    """Per request, tokens served by the optimum of the relaxed cache that may hold a
    token without the tokens before it and hits every cached token of ``P[:-1]``: plain
    paging with unit pages, where farthest-in-future is exact, so at least the optimum."""
    return Optimum(trace, capacity, prefix_closed=False).run()
