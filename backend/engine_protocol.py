"""The engine-process protocol: every message between a stub and the engine process, and
their codec. Nothing here executes what it receives: a frame is msgpack of plain types
(maps, lists, strings, numbers, booleans, nil), decoded into the message dataclasses
below by field name; anything else is refused, in both directions.

    stub -> engine                          engine -> stub
    Start  (the stub that starts it, first) Ready | StartFailed
    Attach (a stub that joins it, first)    Ready
    Generate, Score, Abort                  Outputs (a step's outputs for this stub)
    Query ("stats" | "integrity")           Reply (same token)
    Leave                                   Left (was it the last stub)
                                            StepFailed (every stub)

A frame is a 4-byte big-endian length and a msgpack list of messages, each a map with
its kind under ``"kind"`` (a writer sends what queued up together as one frame).
Step outputs travel as named columns (one list per ``StepOutput`` field, columns that
hold only defaults left out). The steps rank 0 of a tensor-parallel engine sends its
other ranks never cross this socket: they are ``backend/core/parallel/protocol.py``'s.
"""
from __future__ import annotations

import dataclasses
import operator
import socket
import threading
from dataclasses import dataclass
from typing import Any

import msgpack

from backend.core.outputs import ChoiceScore, StepOutput, TokenLogprob

MAX_FRAME_BYTES = 1 << 30


class ProtocolError(ValueError):
    """A frame that is not a valid message (or a message that is not plain data)."""


@dataclass(frozen=True)
class Start:
    config: dict[str, Any]  # EngineConfig's fields
    listen: dict[str, Any] | None = None  # runtime_dir.SocketAddress's fields


@dataclass(frozen=True)
class Attach:
    pass


@dataclass(frozen=True)
class Ready:
    pid: int
    vocab_size: int
    context_len: int


@dataclass(frozen=True)
class StartFailed:
    message: str


@dataclass(frozen=True)
class Generate:
    request_id: str
    prompt: str | list[int]
    params: dict[str, Any]  # SamplingParams.to_dict()
    stream: bool


@dataclass(frozen=True)
class Score:
    request_id: str
    prompt: str | list[int]
    choices: list[str]


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Query:
    token: int
    what: str  # "stats", "integrity" or "flush_cache"


@dataclass(frozen=True)
class Reply:
    token: int
    value: Any  # stats: a map; integrity: None or the failure; flush_cache: slots freed


@dataclass(frozen=True)
class Leave:
    pass


@dataclass(frozen=True)
class Left:
    last: bool  # no stub is left: the engine process ends


@dataclass(frozen=True)
class Outputs:
    outputs: list[StepOutput]
    made_at: float  # the engine's wall clock when they left
    arrivals: dict[str, float] | None = None  # traced requests: when each arrived


@dataclass(frozen=True)
class StepFailed:
    message: str


Message = (Start | Attach | Ready | StartFailed | Generate | Score | Abort | Query | Reply
           | Leave | Left | Outputs | StepFailed)
KINDS: dict[str, type] = {cls.__name__: cls for cls in (
    Start, Attach, Ready, StartFailed, Generate, Score, Abort, Query, Reply, Leave, Left,
    Outputs, StepFailed)}
_FIELD_NAMES = {kind: tuple(f.name for f in dataclasses.fields(cls))
                for kind, cls in KINDS.items()}

# ---- StepOutput columns ------------------------------------------------------------------

_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(StepOutput))
_ROW = operator.attrgetter(*_OUTPUT_FIELDS)
# columns left out when every value is the default: (name, default) (an empty list
# compares equal to the default one)
_OMITTABLE = tuple((i, f.name, None if f.default_factory is dataclasses.MISSING else [])
                   for i, f in enumerate(dataclasses.fields(StepOutput))
                   if f.default is None or f.default_factory is not dataclasses.MISSING)


def _logprob_map(lp: TokenLogprob) -> dict:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top, "rank": lp.rank,
            "text": lp.text, "top_text": lp.top_text}


def _outputs_to_columns(outputs: list[StepOutput]) -> dict[str, Any]:
    """One column per field (read and transposed in C: this runs every step)."""
    n = len(outputs)
    columns = dict(zip(_OUTPUT_FIELDS, zip(*map(_ROW, outputs)))) if n else \
        dict.fromkeys(_OUTPUT_FIELDS, ())
    for i, name, default in _OMITTABLE:
        if columns[name].count(default) == n:
            del columns[name]
    for name in ("logprobs", "prompt_logprobs"):
        if name in columns:
            columns[name] = [None if v is None else [_logprob_map(lp) for lp in v]
                             for v in columns[name]]
    if "choice_scores" in columns:
        columns["choice_scores"] = [None if v is None else [dataclasses.asdict(s) for s in v]
                                    for v in columns["choice_scores"]]
    return columns


def _outputs_from_columns(columns: dict[str, Any]) -> list[StepOutput]:
    for name in ("logprobs", "prompt_logprobs"):
        if name in columns:
            columns[name] = [None if v is None else [TokenLogprob(**lp) for lp in v]
                             for v in columns[name]]
    if "choice_scores" in columns:
        columns["choice_scores"] = [None if v is None else [ChoiceScore(**s) for s in v]
                                    for v in columns["choice_scores"]]
    names = list(columns)
    return [StepOutput(**dict(zip(names, row))) for row in zip(*columns.values())]


# ---- messages <-> plain maps ----------------------------------------------------------------

def to_plain(msg) -> dict:
    kind = type(msg).__name__
    if KINDS.get(kind) is not type(msg):
        raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
    plain = {"kind": kind}
    for name in _FIELD_NAMES[kind]:  # dataclasses.fields rebuilds its tuple every call
        plain[name] = getattr(msg, name)
    if isinstance(msg, Outputs):
        plain["outputs"] = _outputs_to_columns(msg.outputs)
    return plain


def from_plain(plain) -> Message:
    if not isinstance(plain, dict) or not isinstance(plain.get("kind"), str):
        raise ProtocolError("a message must be a map with a kind")
    fields = dict(plain)
    cls = KINDS.get(fields.pop("kind"))
    if cls is None:
        raise ProtocolError(f"unknown message kind {plain['kind']!r}")
    try:
        if cls is Outputs:
            fields["outputs"] = _outputs_from_columns(fields["outputs"])
        return cls(**fields)
    except (TypeError, KeyError) as exc:
        raise ProtocolError(f"malformed {cls.__name__} message: {exc}") from None


def encode(messages: list) -> bytes:
    """One frame's payload; raises ProtocolError for anything that is not plain data."""
    try:
        return msgpack.packb([to_plain(m) for m in messages], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode: {exc}") from None


def decode(payload: bytes) -> list[Message]:
    try:
        plain = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if not isinstance(plain, list):
        raise ProtocolError("a frame must be a list of messages")
    return [from_plain(p) for p in plain]


# ---- framing ---------------------------------------------------------------------------------

class Channel:
    """Framed messages over a connected stream socket; sends from several threads are
    serialized, receiving is one thread's."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, *messages) -> None:
        payload = encode(list(messages))
        with self._send_lock:
            self.sock.sendall(len(payload).to_bytes(4, "big") + payload)

    def recv(self, timeout_s: float | None = None) -> list[Message]:
        """The next frame's messages; EOFError when the peer closed the connection,
        TimeoutError when ``timeout_s`` passed first."""
        self.sock.settimeout(timeout_s)
        try:
            size = int.from_bytes(self._exactly(4), "big")
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {size} bytes")
            return decode(self._exactly(size))
        except socket.timeout:
            raise TimeoutError("no message in time") from None
        finally:
            self.sock.settimeout(None)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("the connection closed")
            got += k
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()



