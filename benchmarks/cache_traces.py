"""Request traces for the cache replay (token ids only; every trace is seeded).

Each trace names its device cache size (``capacity``, tokens) as its definition asks for,
so that its working set relates to the cache as described.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from cache_optimum import TraceRequest


@dataclass
class Trace:
    name: str
    description: str
    requests: list[TraceRequest]
    capacity: int  # device cache, tokens
    # chats only: each request's conversation and arrival time (what an informed policy
    # may know, see cache_informed_bound.py); None where the trace has no conversations
    sessions: list[int] | None = None
    arrivals: list[float] | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


class _Tokens:
    """Fresh token runs: every run differs from every other (no accidental sharing)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def run(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 1_000_000) for _ in range(n)]


def cycle(prefixes: int = 5, fits: int = 4, rounds: int = 40, prefix_len: int = 1024,
          question_len: int = 32, output_len: int = 32, seed: int = 3) -> Trace:
    """The seed's churn case: prefixes requested in a fixed rotation, room for one fewer."""
    tok = _Tokens(seed)
    heads = [tok.run(prefix_len) for _ in range(prefixes)]
    reqs = [TraceRequest(heads[i % prefixes] + tok.run(question_len), tok.run(output_len))
            for i in range(rounds * prefixes)]
    return Trace("cycle", f"{prefixes} prefixes of {prefix_len} tokens in rotation, "
                 f"{rounds} rounds; the cache holds {fits} requests",
                 reqs, fits * (prefix_len + question_len + output_len))


def zipf_tenants(tenants: int = 120, requests: int = 2400, zipf_s: float = 1.0,
                 system_len: tuple[int, int] = (1000, 3000), question_len: tuple[int, int] = (30, 200),
                 output_len: int = 64, cache_share: float = 0.2, seed: int = 5,
                 name: str = "zipf-tenants") -> Trace:
    """Many tenants, each with its own long system prompt, popularity Zipf(s); each
    request asks a new question. The cache holds ``cache_share`` of all system prompts."""
    tok = _Tokens(seed)
    rng = random.Random(seed + 1)
    systems = [tok.run(rng.randint(*system_len)) for _ in range(tenants)]
    weights = [1 / (k + 1) ** zipf_s for k in range(tenants)]
    order = list(range(tenants))
    rng.shuffle(order)  # popularity is not the creation order
    picks = rng.choices(order, weights=weights, k=requests)
    reqs = [TraceRequest(systems[t] + tok.run(rng.randint(*question_len)), tok.run(output_len))
            for t in picks]
    capacity = int(cache_share * sum(map(len, systems)))
    return Trace(name, f"{tenants} tenants, system prompts {system_len[0]}-"
                 f"{system_len[1]} tokens, Zipf({zipf_s}) popularity, {requests} requests; the "
                 f"cache holds {cache_share:.0%} of the system prompts", reqs, capacity)


def multi_turn(users: int = 240, active: int = 32, turns: tuple[int, int] = (3, 9),
               system_len: int = 200, user_len: tuple[int, int] = (50, 300),
               output_len: tuple[int, int] = (100, 300), think_cv: float = 0.5,
               working_set_x: float = 4.0, seed: int = 7, name: str = "multi-turn") -> Trace:
    """Chats of many users, ``active`` at a time, each turn resending the whole history
    (shared system prompt, earlier turns and answers). A user's next turn comes a think
    time after the last (gamma-distributed, coefficient of variation ``think_cv``);
    requests are served in arrival order, and a user who is done is replaced by a new
    one. The cache is 1/``working_set_x`` of the active chats' mean total size."""
    tok = _Tokens(seed)
    rng = random.Random(seed + 1)
    system = tok.run(system_len)
    shape = 1 / think_cv ** 2
    started = 0
    live: list[tuple[float, int, dict]] = []  # (next arrival, tie-break, user)
    reqs: list[TraceRequest] = []
    sessions: list[int] = []
    arrivals: list[float] = []
    working: list[int] = []

    def start(now: float) -> None:
        nonlocal started
        started += 1
        user = {"history": list(system), "left": rng.randint(*turns), "id": started}
        heapq.heappush(live, (now + rng.gammavariate(shape, 1 / shape), started, user))

    while started < active:
        start(rng.random())
    while live:
        now, _, user = heapq.heappop(live)
        prompt = user["history"] + tok.run(rng.randint(*user_len))
        out = tok.run(rng.randint(*output_len))
        reqs.append(TraceRequest(prompt, out))
        sessions.append(user["id"])
        arrivals.append(now)
        user["history"] = prompt + out
        user["left"] -= 1
        working.append(sum(len(u["history"]) for *_, u in live) + len(user["history"]))
        if user["left"]:
            heapq.heappush(live, (now + rng.gammavariate(shape, 1 / shape), _, user))
        elif started < users:
            start(now)
    capacity = int(sum(working) / len(working) / working_set_x)
    return Trace(name, f"{users} users, {active} chatting at a time, {turns[0]}-{turns[1]} "
                 f"turns each, a {system_len}-token system prompt, think times with CV "
                 f"{think_cv:g}; the active chats are {working_set_x:g}x the cache", reqs,
                 capacity, sessions, arrivals)


def hot_and_scans(hot: int = 12, hot_len: int = 2000, requests: int = 1500,
                  burst_every: int = 40, burst: tuple[int, int] = (10, 40), scan_len: int = 6000,
                  question_len: int = 64, output_len: int = 64, cache_x: float = 1.5,
                  seed: int = 11) -> Trace:
    """A hot set of prefixes used over and over, with bursts of one-off long prompts every
    ``burst_every`` hot requests. The cache holds ``cache_x`` times the hot set."""
    tok = _Tokens(seed)
    rng = random.Random(seed + 1)
    heads = [tok.run(hot_len) for _ in range(hot)]
    reqs: list[TraceRequest] = []
    served = 0
    while served < requests:
        reqs.append(TraceRequest(rng.choice(heads) + tok.run(question_len), tok.run(output_len)))
        served += 1
        if served % burst_every == 0:
            for _ in range(rng.randint(*burst)):
                reqs.append(TraceRequest(tok.run(scan_len), tok.run(output_len)))
    return Trace("hot-and-scans", f"{hot} hot prefixes of {hot_len} tokens; every "
                 f"{burst_every} of their requests a burst of {burst[0]}-{burst[1]} one-off "
                 f"{scan_len}-token prompts; the cache holds {cache_x:g}x the hot set",
                 reqs, int(cache_x * hot * (hot_len + question_len + output_len)))


def mixed(seed: int = 23) -> Trace:
    """Tenants, chats and scan bursts at once: three streams merged at random (each keeps
    its own order), a cache the sum of the tenants' and the chats' caches."""
    rng = random.Random(seed)
    tenants = zipf_tenants(tenants=40, requests=900, seed=seed + 1)
    chats = multi_turn(users=120, active=16, seed=seed + 2)
    scans = hot_and_scans(hot=1, requests=300, burst_every=20, burst=(4, 12), seed=seed + 3)
    bursts: list[list[TraceRequest]] = [[]]
    for r in scans.requests:  # the scan trace's one hot prefix is left out
        if len(r.prompt) > 2000 + 64:
            bursts[-1].append(r)
        elif bursts[-1]:
            bursts.append([])
    streams = [[[r] for r in tenants.requests], [[r] for r in chats.requests],
               [b for b in bursts if b]]
    reqs: list[TraceRequest] = []
    while any(streams):
        pick = rng.choices(streams, weights=[len(s) for s in streams])[0]
        reqs.extend(pick.pop(0))
    return Trace("mixed", "40 Zipf tenants, 120 users chatting 16 at a time and bursts of "
                 "one-off 6000-token prompts, merged at random; the cache is the sum of the "
                 "tenants' and the chats' own", reqs, tenants.capacity + chats.capacity)


def all_traces() -> list[Trace]:
    return [cycle(), zipf_tenants(), multi_turn(), hot_and_scans()]


def held_out_traces() -> list[Trace]:
    """Traces the policy's constants were not tuned on: other seeds, other think-time laws,
    another system prompt, the three kinds of traffic at once."""
    return [multi_turn(think_cv=1.0, seed=17, name="chats-exponential"),
            multi_turn(system_len=2000, seed=19, name="chats-long-system"),
            zipf_tenants(zipf_s=0.8, seed=31, cache_share=0.3, name="zipf-0.8"),
            mixed()]
