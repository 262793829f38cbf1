"""radixlm-serve's supervisor (backend/supervisor.py) and the stubs' watch link
(backend/stub_watch.py), around a stand-in for tritonserver: a stub that dies stops the
server, a stop ends within its bound even when the server ignores SIGTERM, the processes
it leaves are ended, and what it leaves on disk is removed. The same against a real
tritonserver: test_server_faults.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backend import admin_access, server_flags
from backend.runtime_dir import SocketAddress
from backend.stub_watch import StubLink, WatchServer, protect_shm_region
from backend.supervisor import shm_prefix

REPO = Path(__file__).resolve().parents[1]

# A stand-in for tritonserver: a shared-memory region named like its stubs', a runtime
# file named for its pid, and (asked by its arguments) a stub connected to the watch
# socket, a grandchild that ignores SIGTERM, SIGTERM ignored by itself.
FAKE_SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from pathlib import Path
    args = sys.argv[1:]
    region = Path("/dev/shm") / (f"radixlm-{os.getppid()}-" + "region")
    region.write_bytes(b"prompt")
    os.chmod(region, 0o644)
    runtime = Path(os.environ["XDG_RUNTIME_DIR"]) / "radixlm"
    (runtime / f"engine-{os.getpid()}-0123.lock").touch()
    stub = "import sys, time\\nfrom backend.stub_watch import StubLink\\n" \\
           "link = StubLink.open('llm', 'llm_0_0')\\n" \\
           "if 'leave' in sys.argv: link.close()\\n" \\
           "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" \\
           "print(flush=True); time.sleep(0.5)\\n" \\
           "if 'stop' in sys.argv: link.request_stop('the engine is not running')\\n" \\
           "time.sleep(600)\\n"
    if "stub" in args:
        child = subprocess.Popen([sys.executable, "-c", stub, *args], stdout=subprocess.PIPE)
        child.stdout.readline()
        print("stub", child.pid, flush=True)
    if "stubborn" in args:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(600)
""")


def run_supervised(tmp_path: Path, *args: str, exit_s=1.0, stub_death_s=0.3,
                   descendants_s=0.5):
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700, exist_ok=True)
    (runtime / "radixlm").mkdir(mode=0o700, exist_ok=True)
    driver = textwrap.dedent(f"""
        import os, sys
        from backend.supervisor import Bounds, ServerPlan, shm_prefix, supervise
        plan = ServerPlan([sys.executable, "-c", {FAKE_SERVER!r}, *{list(args)!r}],
                          dict(os.environ), shm_prefix=shm_prefix(os.getpid()))
        sys.exit(supervise(plan, Bounds({exit_s}, {stub_death_s}, {descendants_s})))
    """)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = {}
    while "ready" not in lines:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        key, _, value = line.strip().partition(" ")
        lines[key] = value
    return proc, lines, runtime / "radixlm"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def leftovers(proc, runtime: Path) -> list[str]:
    return sorted(os.listdir(runtime)) + sorted(
        n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix(proc.pid)))


def test_a_stub_that_dies_stops_the_server_with_a_failure_and_nothing_is_left(tmp_path):
    proc, lines, runtime = run_supervised(tmp_path, "stub")
    stub = int(lines["stub"])
    region = Path("/dev/shm") / f"{shm_prefix(proc.pid)}region"
    deadline = time.monotonic() + 5
    while region.stat().st_mode & 0o777 != 0o600:  # made private as soon as it is seen
        assert time.monotonic() < deadline
        time.sleep(0.05)
    files = sorted(os.listdir(runtime))  # the server's lock file, the stubs' watch socket
    assert len(files) == 2 and files[0].startswith("engine-") and files[1] == f"watch-{proc.pid}.sock"
    os.kill(stub, signal.SIGKILL)
    assert proc.wait(10) == 1
    err = proc.stderr.read()
    assert f"the stub of llm (llm_0_0, pid {stub}) died" in err
    assert "stopping tritonserver" in err and "SIGKILL\n" not in err  # it heeded SIGTERM
    assert "tritonserver ended (-15)" in err
    assert leftovers(proc, runtime) == []
    assert "removed what the server left" in err


def test_a_stop_ends_within_its_bound_when_the_server_ignores_sigterm(tmp_path):
    proc, lines, runtime = run_supervised(tmp_path, "stubborn", "stub", exit_s=1.0)
    stub = int(lines["stub"])  # it ignores SIGTERM too, and outlives its parent
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0  # the stop was asked for
    assert time.monotonic() - started < 1.0 + 0.5 + 2.0
    err = proc.stderr.read()
    assert "got SIGTERM; stopping tritonserver" in err
    assert "still running 1.0 s after the stop began: SIGKILL" in err
    assert f"process {stub} of the server outlived it" in err
    assert not alive(stub)
    assert leftovers(proc, runtime) == []


def test_a_stub_asking_to_stop_ends_the_server_with_a_failure(tmp_path):
    proc, lines, _ = run_supervised(tmp_path, "stub", "stop")
    assert proc.wait(10) == 1
    assert "asks to stop the server: the engine is not running" in proc.stderr.read()


def test_a_stub_that_leaves_before_it_ends_is_no_death(tmp_path):
    proc, lines, _ = run_supervised(tmp_path, "stub", "leave")
    os.kill(int(lines["stub"]), signal.SIGKILL)
    time.sleep(0.5)
    assert proc.poll() is None  # still serving
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0
    assert "died" not in proc.stderr.read()


def test_files_of_a_killed_supervisors_server_are_swept_at_the_next_start(tmp_path):
    ended = subprocess.Popen(["true"])
    ended.wait()
    stale = Path("/dev/shm") / f"{shm_prefix(ended.pid)}old"
    stale.write_bytes(b"x")
    proc, _, runtime = run_supervised(tmp_path)
    try:
        assert not stale.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        stale.unlink(missing_ok=True)


# ---- the watch link alone

def test_the_watch_reports_deaths_and_stop_requests_not_clean_exits(tmp_path):
    address = SocketAddress("watch-test.sock", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    server = WatchServer(address)
    env = {"RADIXLM_WATCH_SOCKET": server.environ_value}
    events = []
    try:
        clean = StubLink.open("pre", "pre_0_0", env)
        dying = StubLink.open("llm", "llm_0_1", env)
        anonymous = __import__("socket").socket(__import__("socket").AF_UNIX)
        address.connect(anonymous)  # never says hello: not a stub
        dying.request_stop("engine gone")
        for _ in range(5):
            events += server.poll(0.05)
        assert sorted(s.instance for s in server.live_stubs()) == ["llm_0_1", "pre_0_0"]
        clean.close()
        anonymous.close()
        dying._sock.close()  # what the kernel does for a killed process
        for _ in range(5):
            events += server.poll(0.05)
    finally:
        server.close()
    assert [(e.kind, e.stub.instance, e.stub.pid) for e in events] == [
        ("stop", "llm_0_1", os.getpid()), ("died", "llm_0_1", os.getpid())]
    assert events[0].reason == "engine gone"
    assert not (tmp_path / "run" / "watch-test.sock").exists()


def test_without_a_supervisor_a_stub_is_not_watched():
    assert StubLink.open("llm", "llm_0_0", {}) is None


def test_a_stub_makes_its_shared_memory_region_private(tmp_path):
    (tmp_path / "shm").mkdir()
    region = tmp_path / "shm" / "radixlm-1-abc"
    region.write_bytes(b"prompt")
    region.chmod(0o644)
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join([b"stub", b"model.py", b"radixlm-1-abc", b"1048576"]))
    assert protect_shm_region(cmdline, tmp_path / "shm") == region
    assert region.stat().st_mode & 0o777 == 0o600
    cmdline.write_bytes(b"stub\0model.py\0../escape")
    assert protect_shm_region(cmdline, tmp_path / "shm") is None


# ---- the flags radixlm-serve and the image add

def test_tritonserver_gets_a_bounded_exit_restricted_admin_apis_and_named_regions():
    args = server_flags.hardened_args(["--http-port=9000"], "t0ken", 4242)
    assert args[0] == "--http-port=9000"
    assert "--exit-timeout-secs=10" in args
    apis = "logging,trace,shared-memory,model-repository"
    assert f"--http-restricted-api={apis}:radixlm-admin-token=t0ken" in args
    assert f"--grpc-restricted-protocol={apis}:radixlm-admin-token=t0ken" in args
    assert ("--grpc-header-forward-pattern=^(radixlm-admin-token|"
            "triton-grpc-protocol-radixlm-admin-token)$") in args
    assert "--backend-config=python,shm-region-prefix-name=radixlm-4242-" in args
    assert server_flags.bounds_for(args, {}).exit_s == 13.0


def test_an_operators_own_settings_win():
    mine = ["--exit-timeout-secs=2", "--http-restricted-api=logging:key=v",
            "--grpc-restricted-protocol=trace:key=v", "--grpc-header-forward-pattern=x",
            "--backend-config=python,shm-region-prefix-name=mine"]
    assert server_flags.hardened_args(mine, "t0ken", 1) == mine
    bounds = server_flags.bounds_for(mine, {"RADIXLM_STUB_DEATH_GRACE_S": "0.5"})
    assert (bounds.exit_s, bounds.stub_death_s) == (5.0, 0.5)


def test_a_token_that_cannot_pass_through_the_flag_or_a_header_is_refused():
    for bad in ("a:b", "a=b", "a,b", "a b", "", "a\nb"):
        with pytest.raises(ValueError, match="RADIXLM_ADMIN_TOKEN"):
            server_flags.hardened_args([], bad, 1)


def test_the_admin_token_is_made_up_when_none_is_given_and_kept_when_given():
    env = {}
    token = admin_access.ensure_token(env)
    assert len(token) >= 40 and env["RADIXLM_ADMIN_TOKEN"] == token
    assert admin_access.ensure_token({"RADIXLM_ADMIN_TOKEN": "mine"}) == "mine"


def test_debug_requests_need_the_token_and_it_never_reaches_the_engine():
    env = {"RADIXLM_ADMIN_TOKEN": "s3cret"}
    params = {"debug": "stats", "Radixlm-Admin-Token": "s3cret", "temperature": 0}
    presented = admin_access.take_presented(params)
    assert params == {"debug": "stats", "temperature": 0}
    assert admin_access.admitted(presented, env)
    grpc = {"triton-grpc-protocol-radixlm-admin-token": "s3cret"}
    assert admin_access.admitted(admin_access.take_presented(grpc), env) and grpc == {}
    assert not admin_access.admitted(["wrong"], env)
    assert not admin_access.admitted([], env)
    assert not admin_access.admitted(["s3cret"], {})  # no token configured: closed
    assert json.dumps(admin_access.refusal()).count("radixlm-admin-token") == 1
