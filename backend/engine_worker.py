"""The engine process itself: ``python -m backend.engine_worker FD``.

It builds an ``Engine`` from the config its first stub sends (``Start``), then runs the
process's one step loop and sends each step's outputs to the stub that submitted them.
One stub starts it over an inherited socket; when that stub asks it to listen, more
stubs (other Triton instances of the same model on the same device) may attach over a
Unix socket and share the engine, its KV pool and its radix cache. Each is a peer: its
requests' outputs and replies go to it alone. Messages: ``backend.engine_protocol``.

It ends when its last peer leaves: by ``Leave``, or by its socket closing (a stub that
died; the requests it had in flight are aborted, freeing their KV slots).
"""
from __future__ import annotations

import collections
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

from backend import engine_protocol as proto
from backend.core.handle import GenerateRequest, ScoreRequest
from backend.core.sampling_params import SamplingParams
from backend.cpu_pinning import LoopPinning
from backend.diagnostics import EngineDiagnostics
from backend.runtime_dir import SocketAddress, UnsafeRuntimeDir, check_peer

log = logging.getLogger("radixlm.engine_worker")


class Peer:
    """One stub's connection. Sends may come from the step loop and a reader thread."""

    def __init__(self, channel: proto.Channel, name: str) -> None:
        self.channel, self.name = channel, name
        self.gone = False

    def send(self, *messages) -> None:
        if not self.gone:
            try:
                self.channel.send(*messages)
            except OSError:
                self.gone = True  # its reader sees the socket close and detaches it


class Worker:
    def __init__(self, engine, ready: proto.Ready, pinning: LoopPinning) -> None:
        self.engine = engine
        self.ready = ready  # for every peer that attaches
        self.pinning = pinning
        self.peers: list[Peer] = []
        self.peers_lock = threading.Lock()
        # request id -> [its peer, finished outputs still to come]: set before the engine
        # sees the request, dropped with its last output
        self.owners: dict[str, list] = {}
        self.controls: collections.deque = collections.deque()  # (peer, Query | Leave)
        self.closing = False
        self.diagnostics = EngineDiagnostics()
        self.listener: socket.socket | None = None
        self.address: SocketAddress | None = None  # to remove at exit

    # ---- peers
    def add_peer(self, channel: proto.Channel, name: str) -> Peer:
        peer = Peer(channel, name)
        with self.peers_lock:
            self.peers.append(peer)
        threading.Thread(target=self.read, args=(peer,), name=f"radixlm-commands-{name}",
                         daemon=True).start()
        return peer

    def remove_peer(self, peer: Peer) -> int:
        """Detach ``peer`` and abort what it still had running; the peers left. With none
        left no stub may attach any more: this process is about to end."""
        with self.peers_lock:
            if peer in self.peers:
                self.peers.remove(peer)
            left = len(self.peers)
            if left == 0 and self.listener is not None:
                try:  # wakes the accept() under way (a close alone would leave it listening)
                    self.listener.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self.listener.close()
                self.listener = None
        for rid in [rid for rid, owner in list(self.owners.items()) if owner[0] is peer]:
            self.engine.abort(rid)
        return left

    def listen(self, address: SocketAddress) -> None:
        """Accept more stubs at ``address`` (a socket file an engine that died left there
        is replaced: the stubs hold a lock while one of them starts this process)."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address.bind(server)
        self.address = address
        server.listen(16)
        self.listener = server
        threading.Thread(target=self._accept, args=(server,), name="radixlm-accept",
                         daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        self.pinning.keep_off_loop()
        count = 1
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return  # closed: the last stub left
            try:
                check_peer(sock)  # another user's process gets nothing, not even Ready
                channel = proto.Channel(sock)
                first = channel.recv(30.0)
                if len(first) != 1 or not isinstance(first[0], proto.Attach):
                    channel.close()
                    continue
                channel.send(self.ready)
            except UnsafeRuntimeDir as exc:
                log.warning("%s", exc)
                continue
            except (EOFError, OSError, TimeoutError, proto.ProtocolError):
                sock.close()
                continue
            self.add_peer(channel, str(count))
            log.info("a stub attached (%d attached)", len(self.peers))
            count += 1

    def remove_socket(self) -> None:
        if self.address is not None:
            self.address.unlink()

    # ---- outputs
    def deliver(self, outputs, made_at: float) -> None:
        """One message per peer with outputs."""
        owners = self.owners
        by_peer: dict[Peer, list] = {}
        for o in outputs:
            owner = owners.get(o.request_id)
            if owner is None:
                continue  # its stub left
            by_peer.setdefault(owner[0], []).append(o)
            if o.finished:
                owner[1] -= 1
                if owner[1] <= 0 or o.error is not None:
                    del owners[o.request_id]
        for peer, outs in by_peer.items():
            peer.send(proto.Outputs(outs, made_at, self.diagnostics.arrivals_of(outs)))

    # ---- commands
    def read(self, peer: Peer) -> None:
        """Commands from one stub; submissions and aborts go straight to the engine."""
        self.pinning.keep_off_loop()
        try:
            while True:
                for msg in peer.channel.recv():
                    if not self.handle(peer, msg):
                        return  # the loop answers Leave and detaches the peer
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a bad message ends this peer, not the engine
            traceback.print_exc()
        peer.gone = True
        if self.remove_peer(peer) == 0:
            self.remove_socket()
            os._exit(0)  # the last stub is gone: nobody to serve

    def handle(self, peer: Peer, msg) -> bool:
        """One command; False once the stub asked to leave."""
        if isinstance(msg, (proto.Generate, proto.Score)):
            rid = msg.request_id
            self.diagnostics.arrived(rid)
            if isinstance(msg, proto.Generate):
                try:
                    params = SamplingParams.from_dict(msg.params)
                except ValueError as exc:
                    peer.send(proto.Outputs([_refusal(rid, str(exc))], time.time()))
                    return True
                # one finished output per sample
                self.owners[rid] = [peer, params.n]
                self.engine.submit(GenerateRequest(rid, msg.prompt, params, msg.stream))
            else:  # one output, carrying every choice's score
                self.owners[rid] = [peer, 1]
                self.engine.submit(ScoreRequest(rid, msg.prompt, msg.choices))
        elif isinstance(msg, proto.Abort):
            self.engine.abort(msg.request_id)
        elif isinstance(msg, (proto.Query, proto.Leave)):  # answered between steps
            self.controls.append((peer, msg))
            self.engine.wake()
            return not isinstance(msg, proto.Leave)
        return True

    def answer_controls(self) -> None:
        while self.controls:
            peer, msg = self.controls.popleft()
            if isinstance(msg, proto.Leave):
                left = self.remove_peer(peer)
                peer.send(proto.Left(left == 0))
                if left == 0:
                    self.closing = True
                    return
                peer.gone = True  # the others go on: this stub's socket is done
                peer.channel.close()
                continue
            if msg.what == "stats":
                self.diagnostics.profile.dump()
                value = dict(self.engine.stats())
                value["engine_loop"] = self.diagnostics.timer.report()
                value["engine_peers"] = len(self.peers)
            elif msg.what == "flush_cache":
                value = self.engine.flush_cache()
            else:
                try:
                    self.engine.check_integrity()
                    value = None
                except AssertionError as exc:
                    value = str(exc) or "failed"
            peer.send(proto.Reply(msg.token, value))

    # ---- the step loop
    def run(self) -> None:
        self.diagnostics.profile.run(self._run)

    def _run(self) -> None:
        engine, timer = self.engine, self.diagnostics.timer
        while not self.closing:
            self.answer_controls()
            if self.closing:
                break
            started = time.perf_counter()
            batch = engine.next_outputs(0.5)
            stepped = time.perf_counter()
            if batch.outputs:
                self.deliver(batch.outputs, batch.made_at)
            if batch.step_error is not None:
                for peer in list(self.peers):
                    peer.send(proto.StepFailed(batch.step_error))
            if batch.outputs or batch.step_error is not None or engine.step_in_flight:
                timer.add("step", stepped - started)
                timer.add("send", time.perf_counter() - stepped)
                timer.steps += 1
            else:
                timer.add("idle", stepped - started)


def _refusal(rid: str, message: str):
    from backend.core.outputs import StepOutput

    return StepOutput.refusal(rid, message)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="radixlm engine process: %(message)s")
    # A SIGTERM or Ctrl-C to the server's process group reaches this process too: the
    # stubs decide when it ends (each aborts its requests in flight and sends each its
    # final response first), by Leave or by going away.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    channel = proto.Channel(socket.socket(fileno=int(argv[0])))
    try:
        [start] = channel.recv()
    except (EOFError, OSError, ValueError):
        return 0
    from backend.core import Engine, EngineConfig

    config = EngineConfig(**start.config)
    pinning = LoopPinning()
    pinning.pin_loop(config.device)
    try:
        engine = Engine(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the stub, which fails to load
        traceback.print_exc()
        channel.send(proto.StartFailed(f"building the engine failed: {type(exc).__name__}: {exc}"))
        return 1
    # What exists now (torch, the model, the tokenizer: ~10^6 objects) lives as long as
    # the process: out of the collector's reach, a full collection no longer stalls a
    # step for 100+ ms while it walks them.
    gc.collect()
    gc.freeze()
    ready = proto.Ready(pid=os.getpid(), vocab_size=engine.runner.vocab_size,
                        context_len=engine.context_len)
    worker = Worker(engine, ready, pinning)
    if start.listen is not None:
        try:
            worker.listen(SocketAddress(**start.listen))
        except OSError as exc:
            channel.send(proto.StartFailed(f"listening at {start.listen} for more stubs "
                                           f"failed: {exc}"))
            return 1
    channel.send(ready)
    worker.add_peer(channel, "0")
    try:
        worker.run()
    finally:
        worker.remove_socket()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
