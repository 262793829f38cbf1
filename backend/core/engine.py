"""The engine: requests in, one scheduled forward pass per ``step()``, outputs out.

Threading: ``add_request``, ``add_score_request`` and ``abort`` may be called from any
thread (they post to an inbox); ``step`` must be called from one loop thread.
"""
from __future__ import annotations

import threading
import time
import uuid

import torch

from .config import EngineConfig
from .loaders import load_tokenizer, open_checkpoint
from .outputs import ChoiceScore, RequestOutput, StepOutput
from .model_runner import ModelRunner
from .radix_cache import NoCache, RadixCache, common_prefix_len
from .request import Req
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .special_tokens import eos_token_ids
from .forward_step import ForwardStep, InFlight
from .step_processor import StepProcessor


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        checkpoint = open_checkpoint(config.model_path)  # refuses what it cannot load
        self.hf_config = checkpoint.config
        self.tokenizer = (load_tokenizer(config.tokenizer_path) if config.tokenizer_path
                          else checkpoint.tokenizer())
        self.runner = ModelRunner(config, self.hf_config, checkpoint.weights)
        self.context_len = self.runner.context_len
        pool = self.runner.kv_pool
        self.cache = RadixCache(pool) if config.enable_radix_cache else NoCache(pool)
        self.scheduler = Scheduler(config, pool, self.runner.req_pool, self.cache, self.context_len)
        self.eos_token_ids = set(eos_token_ids(config.model_path, self.tokenizer))
        self.processor = StepProcessor(self)
        self.forward_step = ForwardStep(self)
        self._inflight: InFlight | None = None
        self.grammar = None  # grammar.GrammarBackend, created with the first constrained request
        self._inbox: list = []
        self._inbox_lock = threading.Lock()
        self._work = threading.Event()
        self._groups: dict[str, list[Req]] = {}  # caller's id -> its samples / choices
        self._live_ids: set[str] = set()  # ids submitted and not yet finished
        self._score_choices: dict[str, list[str]] = {}
        self.counters = {"prompt_tokens": 0, "cache_hit_tokens": 0, "generated_tokens": 0,
                         "finished_requests": 0, "steps": 0, "schedule_seconds": 0.0}

    # ------------------------------------------------------------------ submission
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None,
                    request_id: str | None = None, stream: bool = True) -> str:
        """Queue a prompt; raises ValueError on bad input. Returns the request id.
        ``stream=False``: step outputs carry no text until the last one, which carries all
        of it (the text is decoded once instead of every step)."""
        params = _as_params(sampling_params)
        ids = self._prompt_ids(prompt)
        self._check_fits(ids)
        gid = request_id or uuid.uuid4().hex
        samples = [self._new_req(gid, i, ids, params) for i in range(params.n)]
        for s in samples[1:]:
            s.blocked_by = samples[0] if self.cache.enabled else None  # share one prefill
        self._submit_grammar(samples, params)
        self.processor.attach(samples, stream)
        self._post(("add", gid, samples, None))
        return gid

    def add_score_request(self, prompt: str | list[int], choices: list[str],
                          request_id: str | None = None) -> str:
        """Score each continuation of ``prompt``: its one StepOutput carries
        ``choice_scores`` (sum and mean logprob of the choice's tokens)."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        prefix = self._prompt_ids(prompt) if not isinstance(prompt, str) or prompt else []
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        gid = request_id or uuid.uuid4().hex
        reqs = []
        for i, choice in enumerate(choices):
            full = self.tokenizer.encode(text + choice, add_special_tokens=False) if isinstance(prompt, str) \
                else prefix + self.tokenizer.encode(choice, add_special_tokens=False)
            # the choice starts where its tokenization leaves the prompt's
            start = common_prefix_len(prefix, full)
            start = max(min(start, len(full) - 1), 1)
            self._check_fits(full)
            params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs_start=start)
            reqs.append(self._new_req(gid, i, full, params))
        for r in reqs[1:]:
            r.blocked_by = reqs[0] if self.cache.enabled else None  # prefix prefilled once
        self.processor.attach(reqs)
        self._post(("add", gid, reqs, list(choices)))
        return gid

    def _submit_grammar(self, reqs: list[Req], params: SamplingParams) -> None:
        """Start compiling the request's constraint off this thread; a constraint already
        known to be invalid fails here, others fail when the compilation finishes."""
        constraint = params.constraint
        if constraint is None:
            return
        with self._inbox_lock:
            if self.grammar is None:
                from .grammar import GrammarBackend

                self.grammar = GrammarBackend(
                    self.tokenizer, self.runner.vocab_size, stop_token_ids=sorted(self.eos_token_ids),
                    max_workers=self.config.grammar_compile_threads)
        future = self.grammar.submit(*constraint)
        if future.done() and future.exception() is not None:
            raise ValueError(str(future.exception()))
        for r in reqs:
            r.grammar_future = future

    def _resolve_grammars(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for r in [r for r in self.scheduler.waiting if r.grammar_future is not None]:
            future = r.grammar_future
            if not future.done():
                continue
            r.grammar_future = None
            if future.exception() is not None:
                r.error = str(future.exception())
                outputs += self.processor.finish(r, "abort")
            else:
                r.grammar = self.grammar.create_state(future.result())
        return outputs

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id, None, None))

    def _post(self, msg) -> None:
        with self._inbox_lock:
            if msg[0] == "add":
                if msg[1] in self._live_ids:
                    raise ValueError(f"request id {msg[1]!r} is already in use")
                self._live_ids.add(msg[1])
            self._inbox.append(msg)
        self._work.set()

    def _new_req(self, gid: str, index: int, ids: list[int], params: SamplingParams) -> Req:
        rid = gid if index == 0 else f"{gid}#{index}"
        req = Req(rid=rid, group_id=gid, index=index, origin_input_ids=list(ids), params=params)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + index)
        return req

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < self.runner.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.runner.vocab_size})")
        return ids

    def _check_fits(self, ids: list[int]) -> None:
        if len(ids) >= self.context_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is {self.context_len} "
                             "(prompt plus at least one new token must fit)")
        if len(ids) + 1 > self.runner.kv_pool.size:
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pool holds {self.runner.kv_pool.size}")

    # ------------------------------------------------------------------ the loop
    def has_work(self) -> bool:
        return bool(self._inbox) or self._inflight is not None or self.scheduler.has_work()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        if self.has_work():
            return True
        self._work.clear()
        if self.has_work():
            return True
        return self._work.wait(timeout)

    def wake(self) -> None:
        """End a ``wait_for_work`` early (the caller has something else to do)."""
        self._work.set()

    def step(self) -> list[StepOutput]:
        """One scheduling round. With overlap on, the step launched here runs on the device
        while the host reads and accounts for the previous one; otherwise each step is
        launched and read before returning."""
        outputs = self._drain_inbox()
        outputs += self._resolve_grammars()
        if self._inflight is not None and not self._can_overlap():
            outputs += self._read_inflight()
        started = time.perf_counter()
        items = self.scheduler.schedule()
        self.counters["schedule_seconds"] += time.perf_counter() - started
        self.counters["steps"] += bool(items)
        for req in self.scheduler.forced_finish:
            outputs += self.processor.finish(req, req.finish_reason)
        self.scheduler.forced_finish.clear()
        launched = self.forward_step.launch(items) if items else None
        outputs += self._read_inflight()
        self._inflight = launched
        if not self.config.overlap:
            outputs += self._read_inflight()
        return outputs

    def _read_inflight(self) -> list[StepOutput]:
        flight, self._inflight = self._inflight, None
        return self.processor.process(flight) if flight is not None else []

    def _can_overlap(self) -> bool:
        """Grammar masks, penalties and jump-forward need the previous token on the host
        before the next step is built."""
        return self.config.overlap and not any(
            r.grammar is not None or r.grammar_future is not None or r.penalized
            for r in self.scheduler.running)

    def _drain_inbox(self) -> list[StepOutput]:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        outputs: list[StepOutput] = []
        for kind, gid, reqs, choices in inbox:
            if kind == "add":
                self._groups[gid] = reqs
                if choices is not None:
                    self._score_choices[gid] = choices
                for r in reqs:
                    self.scheduler.add(r)
            else:
                for r in self._groups.get(gid, []):
                    if not r.finished:
                        outputs += self.processor.finish(r, "abort")
        return outputs

    def _forget(self, gid: str) -> None:
        self._groups.pop(gid, None)
        self._score_choices.pop(gid, None)
        with self._inbox_lock:
            self._live_ids.discard(gid)

    def score_output(self, gid: str) -> StepOutput | None:
        """Called when a choice finishes: the group's answer once all choices are done."""
        reqs = self._groups.get(gid, [])
        if not all(r.finished for r in reqs):
            return None
        choices = self._score_choices[gid]
        scores = []
        for choice, r in zip(choices, reqs):
            lps = [lp.logprob for lp in (r.prompt_logprobs or [])]
            scores.append(ChoiceScore(choice, float(sum(lps)), len(lps), lps))
        head = reqs[0]
        abort = any(r.finish_reason == "abort" for r in reqs)
        self._forget(gid)
        return StepOutput(gid, 0, [], "", True, "abort" if abort else "stop",
                          len(head.origin_input_ids), sum(r.num_cached_tokens for r in reqs), 0,
                          choice_scores=None if abort else scores)

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
            self._drain_inbox()
            self.processor.take_results()
            raise
        self.processor.keep_results(ids)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            self.step()
            results.update(self.processor.take_results())
        return [results[i] for i in ids]

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict:
        pool = self.runner.kv_pool
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_tokens_total": pool.size,
            "kv_tokens_used": pool.size - pool.available_size(),
            "kv_tokens_in_use_by_requests": self.cache.protected_size + sum(
                r.num_computed - r.prefix_len for r in self.scheduler.running),
            "radix_cache_tokens": self.cache.total_size(),
            "num_retractions": self.scheduler.num_retractions,
            **self.counters,
        }

    def check_integrity(self) -> None:
        """Every KV slot is exactly one of: free, in the radix tree, or owned by a running
        request. Raises AssertionError on a leak or a double owner."""
        self.cache.check_integrity()
        pool = self.runner.kv_pool
        free, cached, owned = pool.free_slots(), self.cache.cached_slots(), self.scheduler.owned_slots()
        every = sorted(free + cached + owned)
        assert every == list(range(1, pool.size + 1)), (
            f"slot accounting broken: {len(free)} free + {len(cached)} cached + {len(owned)} owned "
            f"!= {pool.size} (or duplicates)")
        if not self.scheduler.running:
            assert self.cache.protected_size == 0, "tree nodes still locked with nothing running"
            assert self.runner.req_pool.available_size() == self.runner.req_pool.num_rows - 1


def _as_params(p) -> SamplingParams:
    if p is None:
        return SamplingParams()
    if isinstance(p, dict):
        return SamplingParams.from_dict(p)
    if isinstance(p, SamplingParams):
        p.validate()
        return p
    raise ValueError(f"sampling params must be SamplingParams or dict, not {type(p).__name__}")
