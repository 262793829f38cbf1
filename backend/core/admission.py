"""In which order waiting requests are considered for admission (``lpm``: longest cached
prefix first, requests passed over ``starvation_bound`` times first of all; ``fcfs``),
and which ones wait a step to share a prompt another admission is computing but has not
put in the tree yet (the later chunks of a chunked prefill; prompts the scheduler could
not share at once)."""
from __future__ import annotations

from .config import EngineConfig
from .radix_cache import RadixCache
from .request import Req

LPM_MAX_QUEUE = 128  # beyond this, matching every waiting request each step costs too much
# A waiting request that shares at least this many uncached tokens with a prompt being
# computed waits a step: next step those tokens come from the cache instead of being
# computed twice. (The usual case, few-shot questions arriving with their examples, needs
# no wait: the scheduler puts a prompt's tokens in the tree when it schedules them.)
IN_BATCH_SHARE_MIN = 16


def shares_uncached(ids: list[int], cached: int, others: list[list[int]]) -> bool:
    """Whether some prompt in ``others`` agrees with ``ids`` on its first ``cached``
    tokens and at least IN_BATCH_SHARE_MIN more. The short window past the cached part is
    compared first: with a hundred few-shot questions admitted in one step, comparing
    whole prompts pairwise cost more than the step itself."""
    end = cached + IN_BATCH_SHARE_MIN
    if len(ids) < end:
        return False
    window = ids[cached:end]
    return any(other[cached:end] == window and other[:cached] == ids[:cached] for other in others)


def admission_order(waiting: list[Req], cache: RadixCache, config: EngineConfig) -> list[Req]:
    if config.schedule_policy == "fcfs" or not cache.enabled or len(waiting) > LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: r.arrival)
    for req in waiting:  # a host-tier hit saves the compute as a device hit does
        # the length alone: no split, no node lists, no copy of the prompt (every waiting
        # request, every step)
        ids = req.origin_input_ids if not req.output_ids else req.fill_ids
        req.cached_match_len = cache.prefix_len(ids, req.max_match_len())
    bound = config.starvation_bound
    starved = [r for r in waiting if r.times_passed_over >= bound]
    rest = [r for r in waiting if r.times_passed_over < bound]
    starved.sort(key=lambda r: r.arrival)
    rest.sort(key=lambda r: (-r.cached_match_len, r.arrival))
    return starved + rest
