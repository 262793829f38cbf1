"""The engine: requests in, one scheduled forward pass per ``step()``, outputs out.

A step is four phases: drain (what other threads posted: new requests, aborts,
finished grammar compilations), schedule (``Scheduler``: which requests run, with how
many tokens), launch (``ForwardStep``: the batch on the device, sampling), postprocess
(``StepProcessor``: the new tokens' bookkeeping and the outputs).

Tensor parallelism (``tensor_parallel_size`` > 1): this engine is rank 0. It starts the
other ranks (``parallel.ranks``), schedules and samples alone, and its model runner
sends each step to them. A rank that dies ends the engine: ``next_outputs`` raises
``EngineDied`` (the serving loop fails every request and readiness with it).

Threading: ``add_request``, ``add_score_request``, ``submit`` and ``abort`` may be
called from any thread (they post to an inbox); ``step`` and ``next_outputs`` from one
loop thread. ``Engine`` is an ``EngineHandle`` (handle.py).
"""
from __future__ import annotations

import logging
import time
import uuid

import torch

from .config import EngineConfig
from .engine_stats import check_kv_accounting, engine_stats
from .loaders import load_tokenizer, open_checkpoint
from .eviction import make_policy
from .forward_step import ForwardStep, InFlight
from .groups import Group, RequestGroups
from .handle import GenerateRequest, OutputBatch, Submission
from .host_memory import KVMover
from .host_tier import HostBlockAllocator
from .inbox import AbortGroup, Inbox, NewGroup, Refusal
from .intake import GrammarProvider, RequestIntake
from .kv_allocator import KVSlotAllocator, TableRowAllocator
from .model_runner import ModelRunner
from .outputs import EngineCounters, RequestOutput, StepOutput
from .parallel.ranks import RankDied, RankGroup
from .radix_cache import NoCache, RadixCache
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .special_tokens import eos_token_ids
from .step_processor import StepProcessor

log = logging.getLogger("radixlm.engine")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        checkpoint = open_checkpoint(config.model_path)  # refuses what it cannot load
        self.hf_config = checkpoint.config
        self.tokenizer = (load_tokenizer(config.tokenizer_path) if config.tokenizer_path
                          else checkpoint.tokenizer())
        self._inbox = Inbox()  # before the ranks: a rank's death wakes the loop through it
        self.ranks = (RankGroup(config, on_failure=self._inbox.wake)
                      if config.tensor_parallel_size > 1 else None)  # ranks 1..N-1
        try:
            self.runner = runner = ModelRunner(config, self.hf_config, checkpoint.weights,
                                               self.ranks.tp if self.ranks else None,
                                               self.ranks)
        except BaseException:
            self.close()
            raise
        self.context_len = runner.context_len
        self.slots = KVSlotAllocator(runner.kv_pool.size)
        self.rows = TableRowAllocator(runner.req_pool.num_rows)
        self.cache = self._make_cache()
        self.kv_mover = KVMover(runner.kv_pool, runner.host_pool, runner.device)
        self.scheduler = Scheduler(config, self.slots, self.rows, self.cache, self.context_len)
        self.eos_token_ids = set(eos_token_ids(config.model_path, self.tokenizer))
        self.grammar = GrammarProvider(self.tokenizer, runner.vocab_size,
                                       sorted(self.eos_token_ids), config.grammar_compile_threads)
        self.intake = RequestIntake(self.tokenizer, runner.vocab_size, self.context_len,
                                    runner.kv_pool.size, self.cache.enabled, self.grammar,
                                    sorted(self.eos_token_ids), config.limits)
        self.groups = RequestGroups()
        self.counters = EngineCounters()
        self.forward_step = ForwardStep(runner, self.grammar)
        self.processor = StepProcessor(self.scheduler, self.groups, self.grammar, self.counters,
                                       self.eos_token_ids, self.context_len,
                                       self.intake.decoder)
        self._inflight: InFlight | None = None

    def _make_cache(self) -> RadixCache:
        if not self.config.enable_radix_cache:
            return NoCache(self.slots)
        host = self.runner.host_pool
        host_blocks = HostBlockAllocator(host.size) if host is not None else None
        policy = make_policy(self.config.radix_eviction_policy,
                             self.slots.size + (host.size if host is not None else 0))
        return RadixCache(self.slots, policy, host_blocks, self.config.host_load_min_tokens)

    # ------------------------------------------------------------------ submission
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None,
                    request_id: str | None = None, stream: bool = True) -> str:
        """Queue a prompt; raises ValueError on bad input. Returns the request id.
        ``stream=False``: step outputs carry no text until the last one, which carries all
        of it (the text is decoded once instead of every step)."""
        params = _as_params(sampling_params)
        gid = request_id or uuid.uuid4().hex
        self._check_admission()
        reqs = self.intake.samples(gid, prompt, params, stream)
        self.groups.claim(gid)
        self._inbox.post(NewGroup(Group(gid, reqs)))
        return gid

    def add_score_request(self, prompt: str | list[int], choices: list[str],
                          request_id: str | None = None) -> str:
        """Score each continuation of ``prompt``: its one StepOutput carries
        ``choice_scores`` (sum and mean logprob of the choice's tokens)."""
        gid = request_id or uuid.uuid4().hex
        self._check_admission()
        reqs = self.intake.choices(gid, prompt, choices)
        self.groups.claim(gid)
        self._inbox.post(NewGroup(Group(gid, reqs, list(choices))))
        return gid

    def abort(self, request_id: str) -> None:
        self._inbox.post(AbortGroup(request_id))

    def _check_admission(self) -> None:
        """The admission bound: refuse new work while too much waits (any thread; the
        counts are read without a lock, which is close enough for a bound)."""
        waiting = len(self.scheduler.waiting) + len(self._inbox)
        bound = self.config.max_waiting_requests
        if waiting >= bound:
            raise ValueError(f"the server is busy: {waiting} requests are waiting to be "
                             f"admitted (model config max_waiting_requests = {bound}); "
                             "retry later")

    def flush_cache(self) -> int:
        """Drop every cached prefix that no running request holds (loop thread only, or
        with the loop idle); returns how many KV slots came back."""
        return self.cache.evict(self.cache.total_size())

    # ------------------------------------------------------------------ EngineHandle
    def submit(self, request: Submission) -> None:
        try:
            if isinstance(request, GenerateRequest):
                self.add_request(request.prompt, request.params, request.request_id,
                                 request.stream)
            else:
                self.add_score_request(request.prompt, request.choices, request.request_id)
        except ValueError as exc:
            self._inbox.post(Refusal(StepOutput.refusal(request.request_id, str(exc))))

    def next_outputs(self, timeout_s: float) -> OutputBatch:
        """One step when there is work, else wait up to ``timeout_s`` for some. A failed
        step is reported in the batch (the loop fails what is pending), not raised; with
        several ranks it raises ``EngineDied`` (they may be out of step with rank 0)."""
        self._check_ranks()
        if not self.wait_for_work(timeout_s):
            self._check_ranks()
            return OutputBatch(made_at=time.time())
        try:
            outputs = self.step()
        except Exception as exc:  # noqa: BLE001 - a bug in a step must not end the loop
            log.exception("engine step failed")
            if self.ranks is not None:
                # the ranks may be mid-step, out of step with this one: end them all
                self.close()
                raise RankDied(self.ranks.failure or f"tensor-parallel step failed: {exc}") \
                    from exc
            return OutputBatch(made_at=time.time(), step_error=f"engine error: {exc}")
        return OutputBatch(outputs, made_at=time.time())

    def _check_ranks(self) -> None:
        if self.ranks is not None and self.ranks.failure is not None:
            self.close()
            self.ranks.check()

    def prompt_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the other tensor-parallel ranks, if any. On one rank nothing is released:
        the engine stays usable for offline calls."""
        if self.ranks is not None:
            self.ranks.close()

    # ------------------------------------------------------------------ the loop
    @property
    def step_in_flight(self) -> bool:
        """A launched step has not been read yet (its slots are taken, its tokens not
        accounted): ``check_integrity`` holds between steps without one."""
        return self._inflight is not None

    def has_work(self) -> bool:
        return (bool(self._inbox) or self._inflight is not None or self.scheduler.has_work()
                or self.kv_mover.loads_pending)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        return self._inbox.wait(self.has_work, timeout)

    def wake(self) -> None:
        """End a ``wait_for_work`` early (the caller has something else to do)."""
        self._inbox.wake()

    def step(self) -> list[StepOutput]:
        """Drain, schedule, launch, postprocess. With overlap on, the step launched here
        runs on the device while the host reads and accounts for the previous one;
        otherwise each step is launched and read before returning."""
        outputs = self._drain()
        for ticket in self.kv_mover.finished_loads():
            self.scheduler.load_done(ticket)
        if self._inflight is not None and not self._can_overlap():
            outputs += self._postprocess()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.counters.schedule_seconds += time.perf_counter() - started
        self.counters.steps += bool(plan.items)
        for req in plan.out_of_room:
            outputs += self.processor.finish(req, "length")
        self.kv_mover.run(plan.host_copies)  # before the forward that may reuse saved slots
        launched = self.forward_step.launch(plan) if plan.items else None
        outputs += self._postprocess()
        self._inflight = launched
        if not self.config.overlap:
            outputs += self._postprocess()
        if launched is None and self.kv_mover.loads_pending:
            self.kv_mover.wait_for_load()  # only loads are left to wait for: no busy loop
        return outputs

    def _drain(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for item in self._inbox.take():
            if isinstance(item, NewGroup):
                self.groups.add(item.group)
                for r in item.group.reqs:
                    self.scheduler.add(r)
            elif isinstance(item, AbortGroup):
                for r in self.groups.members(item.group_id):
                    if not r.finished:
                        outputs += self.processor.finish(r, "abort")
            else:
                outputs.append(item.output)
        for r in [r for r in self.scheduler.waiting if r.grammar_future is not None]:
            future = r.grammar_future
            if not future.done():
                continue
            r.grammar_future = None
            if future.exception() is not None:
                outputs += self.processor.finish(r, "abort", error=str(future.exception()))
            else:
                r.grammar = self.grammar.get().create_state(future.result())
        return outputs

    def _postprocess(self) -> list[StepOutput]:
        flight, self._inflight = self._inflight, None
        return self.processor.process(flight) if flight is not None else []

    def _can_overlap(self) -> bool:
        """Grammar masks, penalties and jump-forward need the previous token on the host
        before the next step is built."""
        return self.config.overlap and not any(
            r.grammar is not None or r.grammar_future is not None or r.penalized
            for r in self.scheduler.running)

    # ------------------------------------------------------------------ offline use
    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp, stream=False))
        except ValueError:
            for rid in ids:  # all or nothing: nobody would collect the ones already queued
                self.abort(rid)
            self._drain()
            raise
        self.groups.collect(ids)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            self.step()
            results.update(self.groups.take_results())
        return [results[i] for i in ids]

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict:
        """Queue lengths, KV use, totals and the host tier's figures (engine_stats.py)."""
        return engine_stats(self.scheduler, self.kv_mover, self.counters, self.context_len)

    def check_integrity(self) -> None:
        """Every KV slot is exactly one of: free, in the radix tree, or owned by a running
        request; every host block is free or in the tree. Raises AssertionError on a leak
        or a double owner (engine_stats.py)."""
        check_kv_accounting(self.scheduler)


def _as_params(p) -> SamplingParams:
    if p is None:
        return SamplingParams()
    if isinstance(p, dict):
        return SamplingParams.from_dict(p)
    if isinstance(p, SamplingParams):
        p.validate()
        return p
    raise ValueError(f"sampling params must be SamplingParams or dict, not {type(p).__name__}")
