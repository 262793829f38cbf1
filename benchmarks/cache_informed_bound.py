"""How close an online policy can come to the optimum on the chat traces, if it knew the
laws that make the traffic (not the traffic itself).

The informed policy knows, for every cached token, which conversation it belongs to, how
many turns that conversation has had and when its last turn arrived (in the trace's own
wall time), and the laws the trace draws from: the number of turns per conversation
(uniform in a range) and the think time between turns (gamma, mean 1, a given CV). It
does not know which conversations come back or when. It ranks a conversation's tokens by
their expected hits per token and unit of time held (the density the adaptive policy
estimates from what it observes):

    P(back) = q S(age) / (q S(age) + 1 - q)    q = P(another turn | turns so far)
    density = P(back) / E[think - age | think > age]

and the shared system prompt above everything. The gap between its share of the optimum
and the adaptive policy's is what learning costs; the gap between it and 100% is the
price of not knowing the future, which no online policy avoids.

    .venv/bin/python benchmarks/cache_informed_bound.py [--traces multi-turn,...] [--knows-ends]
"""
from __future__ import annotations

import argparse
import bisect
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_optimum import hit_upper_bound  # noqa: E402
from cache_replay import HOST_RATIO, replay  # noqa: E402
from cache_traces import Trace, multi_turn  # noqa: E402

from backend.core.eviction import EvictionPolicy, NodeStats  # noqa: E402

SAMPLES = 200_000
ALWAYS = 1e18  # the shared system prompt: every turn of every chat uses it


class ThinkLaw:
    """Survival and mean residual life of gamma think times (mean 1), from samples."""

    def __init__(self, cv: float, seed: int = 0) -> None:
        rng = random.Random(seed)
        shape = 1 / cv ** 2
        self.samples = sorted(rng.gammavariate(shape, 1 / shape) for _ in range(SAMPLES))
        self.suffix = [0.0] * (SAMPLES + 1)  # sum of samples[i:]
        for i in range(SAMPLES - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + self.samples[i]

    def tail(self, age: float) -> tuple[float, float]:
        """(P(T > age), E[T - age | T > age])."""
        i = bisect.bisect_right(self.samples, age)
        left = SAMPLES - i
        if left == 0:
            return 0.0, 1.0
        return left / SAMPLES, self.suffix[i] / left - age


class InformedPolicy(EvictionPolicy):
    name = "informed"
    trims = True

    def __init__(self, trace: Trace, system_len: int, turns: tuple[int, int], law: ThinkLaw,
                 knows_ends: bool = False):
        assert trace.sessions is not None and trace.arrivals is not None
        self.trace, self.system_len, self.turns, self.law = trace, system_len, turns, law
        # knows_ends: also told which conversation has had its last turn (a stronger
        # oracle, to show how much of the gap is the timing of the turns alone)
        self.total_turns = {c: trace.sessions.count(c) for c in set(trace.sessions)} \
            if knows_ends else None
        self.chat_of: dict[int, int] = {}  # first token after the system prompt -> chat
        for r, chat in zip(trace.requests, trace.sessions):
            token = r.prompt[system_len]
            assert self.chat_of.setdefault(token, chat) == chat, "two chats share a token"
        self.turns_done: dict[int, int] = {}
        self.last_arrival: dict[int, float] = {}
        self.now = 0.0

    def before_request(self, i: int) -> None:
        """Request i arrives: the requests before it are all done."""
        if i > 0:
            chat = self.trace.sessions[i - 1]
            self.turns_done[chat] = self.turns_done.get(chat, 0) + 1
            self.last_arrival[chat] = self.trace.arrivals[i - 1]
        self.now = self.trace.arrivals[i]

    def priority(self, node: NodeStats, now: int, crowded: bool = False) -> float:
        if node.depth + len(node.key) <= self.system_len:
            return ALWAYS
        while node.depth > self.system_len:
            node = node.parent
        chat = self.chat_of[node.key[self.system_len - node.depth]]
        done = self.turns_done.get(chat, 0)
        lo, hi = self.turns
        q = 1.0 if done < lo else (hi - done) / (hi - done + 1) if done < hi else 0.0
        if self.total_turns is not None:
            q = 1.0 if done < self.total_turns[chat] else 0.0
        survival, remaining = self.law.tail(self.now - self.last_arrival.get(chat, self.now))
        back = q * survival / (q * survival + 1 - q) if q > 0 else 0.0
        return back / max(remaining, 1e-9)


CHAT_TRACES = {  # name -> (trace, its system prompt, turns, think-time CV)
    "multi-turn": (multi_turn, 200, (3, 9), 0.5),
    "chats-exponential": (lambda: multi_turn(think_cv=1.0, seed=17, name="chats-exponential"),
                          200, (3, 9), 1.0),
    "chats-long-system": (lambda: multi_turn(system_len=2000, seed=19,
                                             name="chats-long-system"), 2000, (3, 9), 0.5),
}


def bound(name: str, knows_ends: bool = False) -> list[dict]:
    """Rows of the informed policy's share of the optimum on the chat trace ``name``,
    GPU-only and with the host tier."""
    make, system_len, turns, cv = CHAT_TRACES[name]
    trace = make()
    law = ThinkLaw(cv)
    rows = []
    for host_tokens in (0, HOST_RATIO * trace.capacity):
        best = sum(hit_upper_bound(trace.requests, trace.capacity + host_tokens))
        policy = InformedPolicy(trace, system_len, turns, law, knows_ends)
        res = replay(trace.requests, trace.capacity, policy, host_tokens,
                     before_each=policy.before_request)
        rows.append({"trace": name, "knows": "laws + ends" if knows_ends else "laws",
                     "host_tier": bool(host_tokens),
                     "hit_rate": round(res.hits / res.prompt_tokens, 4),
                     "optimal_hit_rate": round(best / res.prompt_tokens, 4),
                     "share_of_optimum": round(res.hits / best, 4)})
        r = rows[-1]
        print(f"{name:18s} knows {r['knows']:10s} host={'on ' if host_tokens else 'off'} hit "
              f"{100 * r['hit_rate']:5.1f}%  optimum {100 * r['optimal_hit_rate']:5.1f}%  -> "
              f"{100 * r['share_of_optimum']:5.1f}% of optimum", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=",".join(CHAT_TRACES))
    ap.add_argument("--knows-ends", action="store_true",
                    help="also tell the policy which conversations have ended")
    args = ap.parse_args()
    for name in args.traces.split(","):
        bound(name, args.knows_ends)


if __name__ == "__main__":
    main()
