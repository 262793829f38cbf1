"""The engine-process protocol (backend/engine_protocol.py) and where its socket lives
(backend/runtime_dir.py): plain data only on the wire, every message round-trips by
field name, and no folder or peer of another user is trusted."""
from __future__ import annotations

import ast
import os
import socket
import subprocess
from pathlib import Path

import pytest

from backend import engine_protocol as proto
from backend.core.outputs import ChoiceScore, StepOutput, TokenLogprob
from backend.core.sampling_params import SamplingParams
from backend.runtime_dir import FileLock, PrivateDir, SocketAddress, UnsafeRuntimeDir, check_peer

BACKEND = Path(__file__).resolve().parents[1] / "backend"


def roundtrip(*messages):
    return proto.decode(proto.encode(list(messages)))


def test_every_message_kind_round_trips_by_field_name():
    params = SamplingParams(max_new_tokens=7, temperature=0.0, stop=["\n"], n=2)
    messages = [proto.Start({"model_path": "m", "device": "cpu"}, {"name": "s", "folder": "/x"}),
                proto.Attach(), proto.Ready(pid=3, vocab_size=10, context_len=64),
                proto.StartFailed("no weights"),
                proto.Generate("r1", [1, 2, 3], params.to_dict(), True),
                proto.Score("r2", "Is it?", ["yes", "no"]), proto.Abort("r1"),
                proto.Query(4, "stats"), proto.Reply(4, {"num_running": 1}), proto.Leave(),
                proto.Left(True), proto.StepFailed("engine error: boom")]
    assert roundtrip(*messages) == messages
    assert SamplingParams.from_dict(roundtrip(messages[4])[0].params) == params


def test_step_outputs_cross_as_typed_records():
    outputs = [
        StepOutput(request_id="a", index=1, new_token_ids=[5, 6], new_text="hé", num_output_tokens=2,
                   logprobs=[TokenLogprob(5, -0.5, {5: -0.5, 9: -1.25}), TokenLogprob(6, -0.1)],
                   context_token_ids=[1, 2], timings=None),
        StepOutput(request_id="b", finished=True, finish_reason="stop",
                   choice_scores=[ChoiceScore(" yes", -1.5, 3, [-0.5, -0.5, -0.5])],
                   timings={"e2e_latency": 0.25}),
        StepOutput.refusal("c", "prompt is empty"),
    ]
    [back] = roundtrip(proto.Outputs(outputs, made_at=12.5, arrivals={"a": 11.0}))
    assert back == proto.Outputs(outputs, 12.5, {"a": 11.0})
    assert isinstance(back.outputs[0].logprobs[0], TokenLogprob)
    assert back.outputs[0].logprobs[0].top == {5: -0.5, 9: -1.25}


def test_the_codec_refuses_anything_but_plain_data():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(proto.ProtocolError):
        proto.encode([proto.Generate("r", [1], {"seed": Evil()}, True)])
    with pytest.raises(proto.ProtocolError):
        proto.encode([("add", "r", [1])])  # a bare tuple is not a message
    import msgpack
    with pytest.raises(proto.ProtocolError, match="unknown message kind"):
        proto.decode(msgpack.packb([{"kind": "Exec", "code": "print(1)"}]))
    with pytest.raises(proto.ProtocolError, match="malformed"):
        proto.decode(msgpack.packb([{"kind": "Abort", "request_id": "r", "extra": 1}]))
    with pytest.raises(proto.ProtocolError):
        proto.decode(msgpack.packb([{"kind": "Abort"}], use_bin_type=True) + b"\xc1")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("module", ["engine_protocol.py", "engine_process.py",
                                    "engine_worker.py", "runtime_dir.py"])
def test_nothing_on_the_engine_process_path_imports_pickle(module):
    imported = _imports(BACKEND / module)
    assert not imported & {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle",
                           "multiprocessing", "multiprocessing.connection"}, imported


def test_a_channel_carries_frames_both_ways():
    a, b = socket.socketpair()
    left, right = proto.Channel(a), proto.Channel(b)
    left.send(proto.Abort("x"), proto.Leave())
    assert right.recv(5.0) == [proto.Abort("x"), proto.Leave()]
    left.close()
    with pytest.raises(EOFError):
        right.recv(5.0)
    right.close()


def test_the_runtime_folder_is_made_private(tmp_path):
    with PrivateDir(tmp_path / "run") as d:
        assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o700
        assert d.path("x.sock").startswith(f"/proc/self/fd/{d.fd}/")


def test_a_folder_of_another_user_is_refused(tmp_path):
    (tmp_path / "run").mkdir(mode=0o700)
    with pytest.raises(UnsafeRuntimeDir, match="must be a folder of user"):
        PrivateDir(tmp_path / "run", expected_uid=os.getuid() + 1)


def test_a_folder_others_may_enter_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    os.chmod(tmp_path / "run", 0o755)
    with pytest.raises(UnsafeRuntimeDir, match="mode 0700"):
        PrivateDir(tmp_path / "run")


def test_a_symlinked_folder_is_refused_even_when_its_target_is_private(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeRuntimeDir, match="not a plain folder"):
        PrivateDir(tmp_path / "run")
    with pytest.raises(UnsafeRuntimeDir):
        SocketAddress("engine.sock", str(tmp_path / "run")).connect(socket.socket(socket.AF_UNIX))


def test_a_peer_of_another_user_is_refused(tmp_path):
    address = SocketAddress("engine.sock", str(tmp_path / "run"))
    PrivateDir(tmp_path / "run").close()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address.bind(server)
    server.listen(1)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address.connect(client)  # same user: accepted by the client's own check
    conn, _ = server.accept()
    with pytest.raises(UnsafeRuntimeDir, match="refused a peer of user"):
        check_peer(conn, expected_uid=os.getuid() + 1)  # as if the peer were someone else
    assert conn.fileno() == -1  # closed
    assert client.recv(1) == b""  # the peer sees the connection end
    client.close()
    server.close()
    address.unlink()
    assert not address.exists()


def test_a_lock_file_removed_by_its_holder_is_not_shared_by_the_next_two(tmp_path):
    PrivateDir(tmp_path / "run").close()
    lock = FileLock(str(tmp_path / "run"), "engine.lock")
    with lock:
        lock.remove()
    assert os.listdir(tmp_path / "run") == []
    with FileLock(str(tmp_path / "run"), "engine.lock"):
        assert os.listdir(tmp_path / "run") == ["engine.lock"]


def test_files_of_processes_that_ended_are_swept_and_the_others_kept(tmp_path):
    ended = subprocess.Popen(["true"])
    ended.wait()
    names = [f"engine-{ended.pid}-ab12.lock", f"engine-{ended.pid}-ab12.sock",
             f"watch-{ended.pid}.sock", f"engine-{os.getpid()}-cd34.lock",
             f"watch-{os.getpid()}.sock", "notes.txt", "engine-x.lock"]
    with PrivateDir(tmp_path / "run") as d:
        for name in names:
            (tmp_path / "run" / name).touch()
        assert sorted(d.remove_files_of_dead()) == sorted(names[:3])
        assert sorted(os.listdir(tmp_path / "run")) == sorted(names[3:])
        assert sorted(d.remove_files_of(os.getpid())) == sorted(names[3:5])
        assert sorted(os.listdir(tmp_path / "run")) == ["engine-x.lock", "notes.txt"]
