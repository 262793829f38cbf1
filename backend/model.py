"""RadixLM as a decoupled Triton Python-based backend (``backend: "radixlm"``).

With ``backend.triton_io`` (reading requests, writing responses through response
senders, Triton's custom metrics API), the only module that knows Triton's
``triton_python_backend_utils`` and the stub process it runs in. It watches the stop
signals and leaves everything else to ``backend.wire`` (the wire contract),
``backend.serving`` (the engine loop) and ``backend.metrics`` (what the metrics are).

Engine failure: if the engine loop thread dies, every request fails with the reason and
``is_ready`` turns false (Triton versions with user-defined readiness, python_backend
2026+, report the model not ready). Triton 2.51 has no such hook and keeps a model ready
even when its stub process is gone, so by default (``RADIXLM_ON_ENGINE_FAILURE=shutdown``)
the stub asks radixlm-serve's supervisor (``backend.supervisor``; tritonserver itself when
there is none) to stop the server: readiness fails at once and the process exits within
the supervisor's bound, for the orchestrator to restart it. A stub that dies outright is
noticed by the supervisor alone (``backend.stub_watch``).
``RADIXLM_ON_ENGINE_FAILURE=serve_errors`` keeps the server up, answering the model's
requests with the error.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend import admin_access, wire
from backend.diagnostics import IpcCounts
from backend.engine_process import EngineProcess
from backend.metrics import EngineMetrics
from backend.model_config import (PROJECT_ROOT, check_tensor_parallel_instance,
                                  engine_config_from_parameters, engine_process_wanted,
                                  instances_on_device, read_model_info, request_timeout_s,
                                  time_limit_s, vllm_metrics_wanted)
from backend.server_lifecycle import (model_ready_url, not_ready, stop_tritonserver,
                                      watch_stop_signals)
from backend.serving import EngineLoop
from backend.shared_engine import open_shared
from backend.stub_watch import StubLink, protect_shm_region
from backend.triton_io import (TritonMetricFactory, TritonResponseSink, read_inputs,
                               read_parameters)

ON_ENGINE_FAILURE = "RADIXLM_ON_ENGINE_FAILURE"  # "shutdown" (default) or "serve_errors"


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        for spec in wire.INPUT_SPECS:
            auto_complete_model_config.add_input(dict(spec))
        for spec in wire.OUTPUT_SPECS:
            auto_complete_model_config.add_output(dict(spec))
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        return auto_complete_model_config

    def initialize(self, args) -> None:
        protect_shm_region()  # before any prompt passes through it
        self.watch = None
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                "the radixlm backend streams: set model_transaction_policy { decoupled: true }")
        parameters = {key: value["string_value"]
                      for key, value in model_config.get("parameters", {}).items()}
        # Relative paths resolve against the model's folder, the model repository, and
        # the folder holding the repository (the project root for model_repository/).
        model_dir = Path(args["model_repository"])
        search_dirs = [model_dir, model_dir.parent, model_dir.parent.parent, PROJECT_ROOT]
        config = engine_config_from_parameters(parameters, search_dirs)
        self.request_timeout_s = request_timeout_s(parameters)
        self.parser = wire.RequestParser(config.limits)
        self.logger = pb_utils.Logger
        self._check_model_info(parameters, search_dirs)
        if args.get("model_instance_kind") == "GPU" and config.device == "cuda":
            # KIND_GPU places one instance per GPU: pin this one to its device (the first
            # of its tensor-parallel ranks' GPUs)
            check_tensor_parallel_instance("GPU", int(args["model_instance_device_id"]),
                                           config.tensor_parallel_size)
            device = f"cuda:{args['model_instance_device_id']}"
            config = dataclasses.replace(config, device=device)

        # The routing thread and the response senders share this interpreter (and, with
        # engine_process false, the engine's step loop too). With the default 5 ms GIL
        # switch interval a thread woken from a GIL-releasing wait (a CUDA sync, a socket
        # read) could queue up to 5 ms behind a sender building a response. A short
        # interval bounds that wait.
        sys.setswitchinterval(float(os.environ.get("RADIXLM_SWITCH_INTERVAL_S", "0.0005")))
        instances = instances_on_device(model_config, args.get("model_instance_kind", ""),
                                             int(args.get("model_instance_device_id") or 0))
        key = f"{os.getppid()}-{args['model_name']}-{args.get('model_version', '')}"
        self.engine, reports_gauges = self._open_engine(config, parameters, instances, key)
        self.model_name = args["model_name"]
        self.stop_signal = watch_stop_signals()
        self.ready_url = model_ready_url(self.model_name, str(args.get("model_version", "")))
        self.logger.log_info(f"radixlm: server shutdown is read from {self.ready_url}"
                             if self.ready_url else
                             "radixlm: tritonserver serves no HTTP; server shutdown is read "
                             "from the model's readiness")
        if self.stop_signal is None:
            self.logger.log_warn("radixlm: cannot watch SIGTERM/SIGINT here; server shutdown "
                                 "is noticed by polling the model's readiness only")
        self.ipc = IpcCounts()  # round trips to the server, reported with the debug stats
        self.metric_factory = TritonMetricFactory(self.ipc) \
            if hasattr(pb_utils, "MetricFamily") else None
        self.metrics = None
        if self.metric_factory is not None:
            self.metrics = EngineMetrics(
                self.metric_factory, args["model_name"], args["model_instance_name"],
                gauges=reports_gauges, version=str(args.get("model_version", "1")),
                vllm_series=vllm_metrics_wanted(parameters),
                max_model_len=int(self.engine.stats().get("context_len", 32768)))
            self.metrics.start()
        self.loop = EngineLoop(self.engine, on_error=self.logger.log_error,
                               sender_threads=int(os.environ.get("RADIXLM_SENDER_THREADS", "2")),
                               on_info=self.logger.log_info,
                               server_stopping=self._server_stopping,
                               metrics=self.metrics, on_death=self._on_engine_death,
                               ipc_counts=self.ipc)
        # Everything loaded so far lives as long as the stub: keep the cyclic collector
        # from walking it (a full collection of torch + transformers stalls every
        # thread here for 100+ ms).
        gc.collect()
        gc.freeze()
        self.loop.start()
        # Last: a stub that dies while loading fails the load; Triton reports that itself.
        self.watch = StubLink.open_logged(self.model_name, args["model_instance_name"],
                                          self.logger.log_error)
        self.logger.log_info("radixlm: engine ready" + (
            "; radixlm-serve watches this stub" if self.watch is not None else
            " (no radixlm-serve supervisor: a crash of this stub is not noticed)"))

    def _open_engine(self, config, parameters: dict, instances: int, key: str):
        """The engine handle for this instance, and whether this instance reports the
        engine-wide gauges. Which run mode runs when: docs/architecture.md."""
        if not engine_process_wanted(parameters, config.device, instances,
                                     config.tensor_parallel_size):
            from backend.core import Engine  # in this process: the CPU default

            self.logger.log_info(f"radixlm: building the engine: {config}")
            return Engine(config), True
        # its own process: the step loop never waits for this interpreter's lock
        if instances > 1:
            # every instance of this model on this device fronts one engine (one KV pool,
            # one radix cache): see backend/engine_process.py
            self.logger.log_info(f"radixlm: building or joining the engine of {key}: {config}")
            engine = open_shared(config, key)
        else:
            self.logger.log_info(f"radixlm: building the engine: {config}")
            engine = EngineProcess(config)
        if engine.started_here:
            self.logger.log_info(f"radixlm: the engine runs in process {engine.pid} "
                                 f"({engine.python})")
        else:
            self.logger.log_info(f"radixlm: attached to the engine process {engine.pid}"
                                 f" ({instances} instances share it)")
        return engine, engine.started_here

    def _server_stopping(self) -> bool:
        """Polled by the engine loop while requests are pending (never after finalize).
        A signal to the stub's process group is one sign; the other covers a SIGTERM to
        tritonserver alone (Kubernetes signals only the container's first process) and an
        unload of this model: from then on Triton's HTTP endpoint no longer answers, or
        says this model is not ready (the server's own readiness would also turn false
        when another model fails to load: server_lifecycle.model_ready_url). It is asked
        over HTTP: ``pb_utils.is_model_ready`` crashed the stub (SIGSEGV) when asked while
        the server was unloading models."""
        if self.stop_signal is not None and self.stop_signal.is_set():
            return True
        if self.ready_url is not None:
            return not_ready(self.ready_url)
        try:  # no HTTP: the query that crashed during unloads is all there is
            return not pb_utils.is_model_ready(self.model_name)
        except pb_utils.TritonModelException:
            return True

    def is_ready(self) -> bool:
        """Triton's user-defined readiness (python_backend 2026+; 2.51 never calls it)."""
        loop = getattr(self, "loop", None)
        return loop is not None and loop.failure is None

    def _on_engine_death(self, reason: str) -> None:
        action = os.environ.get(ON_ENGINE_FAILURE, "shutdown")
        self.logger.log_error(f"radixlm: the engine is not running ({reason}); every "
                              f"request of this model now fails ({ON_ENGINE_FAILURE}={action})")
        if action != "shutdown":
            return
        if self.watch is not None:  # the supervisor stops it, within its bound
            self.watch.request_stop(f"the engine is not running ({reason})")
        else:
            stop_tritonserver(self.logger)

    def _check_model_info(self, parameters: dict, search_dirs: list[Path]) -> None:
        """Clients read chat_template / eos_token / bos_token from config.pbtxt (Triton
        keeps a Python backend from adding parameters itself): warn when they disagree
        with the served model's tokenizer files."""
        for key, value in read_model_info(parameters, search_dirs).items():
            if key in parameters and parameters[key] != value:
                self.logger.log_warn(f"radixlm: config.pbtxt parameter {key!r} differs from "
                                     "the model's tokenizer files; clients will use the former")

    def execute(self, requests):
        """Only parse and hand over: the engine loop thread sends every response."""
        started = time.perf_counter()
        for request in requests:
            sink = TritonResponseSink(request, self.ipc)
            try:
                parameters = read_parameters(request)
                presented = admin_access.take_presented(parameters)
                if wire.DEBUG in parameters and not admin_access.admitted(presented):
                    sink.send_error(admin_access.refusal())
                    continue
                if self.loop.diagnostics.wants_fault(parameters, wire.DEBUG):
                    self.loop.inject_fault("fault injected by a debug request")
                    sink.send_error("fault injected: the engine loop will die")
                    continue
                job = self.parser.parse(read_inputs(request), parameters, sink.wanted)
            except wire.InputError as exc:
                sink.send_error(str(exc))
                continue
            except Exception as exc:  # a bug here must fail this request, not the batch
                self.logger.log_error(f"radixlm: parsing a request failed: {exc!r}")
                sink.send_error(f"internal error: {exc}")
                continue
            self.loop.submit(job, sink, request.request_id() if self.loop.tracing else None,
                             self._timeout_s(request, job))
        self.loop.note_intake(started, time.perf_counter(), len(requests))
        return None

    def _timeout_s(self, request, job) -> float | None:
        try:
            asked_us = request.timeout()  # the client's Triton timeout, in microseconds
        except AttributeError:  # an older python backend
            asked_us = 0
        streamed = isinstance(job, wire.GenerateJob) and job.stream
        return time_limit_s(streamed, self.request_timeout_s, asked_us)

    def finalize(self) -> None:
        if getattr(self, "watch", None) is not None:
            self.watch.close()  # from now on this stub's exit is expected
            self.watch = None
        loop = getattr(self, "loop", None)
        if loop is not None:
            self.logger.log_info("radixlm: finalize: stopping the engine loop")
            loop.stop()
            self.logger.log_info("radixlm: engine loop stopped")
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()  # the metrics before their families
            self.metrics = None
            self.metric_factory.close()
