"""Several stubs in front of one engine process (backend/engine_process.py, ``listen`` /
``attach`` / ``open_shared``): each stub gets exactly its own requests' outputs, they share
one radix cache, the engine outlives the stub that started it until the last one leaves,
and a stub that dies has its requests aborted without disturbing the others."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from backend.core import EngineConfig, SamplingParams
from backend.engine_process import EngineProcess
from backend.shared_engine import open_shared, shared_address
from backend.runtime_dir import SocketAddress
from engine_helpers import make_engine, random_prompts, tiny_model
from test_engine_process import SETTINGS, _alive, add, by_request, run_until_finished, wait_gone

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("shared_engine"), "llama")


@pytest.fixture
def config(model_path):
    return EngineConfig(model_path=str(model_path), **SETTINGS)


def address() -> SocketAddress:
    return SocketAddress(f"radixlm-test-{uuid.uuid4().hex}")  # abstract


def test_each_stub_gets_only_its_requests_and_they_share_the_radix_cache(config, model_path):
    where = address()
    first = EngineProcess(config, listen=where)
    second = EngineProcess.attach(where, config)
    try:
        assert first.started_here and not second.started_here
        assert second.pid == first.pid
        prompts = random_prompts(6, 200, seed=5, min_len=20, max_len=40)
        expected = [r.token_ids for r in make_engine(model_path).generate(prompts, GREEDY)]
        for i, p in enumerate(prompts):
            add(first if i % 2 == 0 else second, p, GREEDY, f"r{i}")
        got_first = by_request(run_until_finished(first, 3))
        got_second = by_request(run_until_finished(second, 3))
        assert sorted(got_first) == ["r0", "r2", "r4"] and sorted(got_second) == ["r1", "r3", "r5"]
        for i in range(6):
            assert (got_first if i % 2 == 0 else got_second)[f"r{i}"] == expected[i]
        # a prompt the first stub's request left in the tree is a hit for the second's
        add(second, prompts[0], GREEDY, "again")
        again = run_until_finished(second, 1)
        assert again[-1].num_cached_tokens >= len(prompts[0]) - 1
        stats = second.stats()
        assert stats["engine_peers"] == 2 and stats["num_running"] == 0
        second.check_integrity()
    finally:
        second.close()
        first.close()


def test_the_engine_serves_on_until_its_last_stub_leaves(config):
    where = address()
    first = EngineProcess(config, listen=where)
    second = EngineProcess.attach(where, config)
    child = first.pid
    started = time.monotonic()
    first.close()  # the stub that started it leaves first
    assert time.monotonic() - started < 5 and _alive(child)
    add(second, [7, 8, 9], GREEDY, "after")
    assert len(by_request(run_until_finished(second, 1))["after"]) == 10
    assert second.stats()["engine_peers"] == 1
    second.close()
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
        EngineProcess.attach(where, config)  # it stopped listening before it said bye
    wait_gone(child, "its last stub")


def test_a_stub_that_dies_has_its_requests_aborted_and_the_others_go_on(config, model_path,
                                                                        tmp_path):
    where = address()
    first = EngineProcess(config, listen=where)
    script = tmp_path / "stub.py"
    script.write_text(
        "import sys, time\n"
        "from backend.core import EngineConfig, SamplingParams\n"
        "from backend.core.handle import GenerateRequest\n"
        "from backend.engine_process import EngineProcess\n"
        "from backend.runtime_dir import SocketAddress\n"
        f"e = EngineProcess.attach(SocketAddress({where.name!r}), "
        f"EngineConfig(model_path={str(model_path)!r}, **{SETTINGS!r}))\n"
        "e.submit(GenerateRequest('doomed', [30, 31, 32], SamplingParams(max_new_tokens=1000, "
        "temperature=0.0, ignore_eos=True)))\n"
        "while not e.next_outputs(0.5).outputs: pass\n"
        "print('running', flush=True)\n"
        "time.sleep(600)\n")
    stub = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        assert stub.stdout.readline().strip() == "running"
        assert first.stats()["num_running"] == 1
        stub.kill()
        stub.wait(10)
        deadline = time.monotonic() + 30
        while (stats := first.stats())["num_running"] or stats["engine_peers"] != 1:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats["kv_tokens_in_use_by_requests"] == 0
        assert stats["generated_tokens"] < 500, stats  # aborted: run to its end, 1,000
        first.check_integrity()
        add(first, [40, 41], GREEDY, "still")
        outputs = run_until_finished(first, 1)
        assert {o.request_id for o in outputs} == {"still"}  # nothing of the dead stub's
    finally:
        stub.kill()
        first.close()


def test_open_shared_starts_the_engine_once_and_attaches_after(config, tmp_path):
    key = f"test-{uuid.uuid4().hex}"
    folder = tmp_path / "run"
    address, lock_name = shared_address(config, key, folder, server_pid=os.getpid())
    assert address.name.startswith(f"engine-{os.getpid()}-")  # swept once this pid is gone
    open_shared_here = lambda cfg: open_shared(cfg, key, folder=folder,  # noqa: E731
                                               server_pid=os.getpid())
    folder.mkdir(mode=0o700)
    # the socket file an engine process that died left behind
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(folder / address.name))
    stale.close()
    first = open_shared_here(config)
    second = open_shared_here(config)
    other = open_shared_here(dataclasses.replace(config, max_running_requests=8))
    try:
        assert first.started_here and not second.started_here
        assert first.pid == second.pid
        assert other.started_here and other.pid != first.pid  # new settings, new engine
        assert oct(folder.stat().st_mode & 0o777) == "0o700"  # this user's only
    finally:
        for engine in (second, first, other):
            engine.close()
    # the last stub gone: the engine removed its socket, the stubs their lock files
    assert sorted(os.listdir(folder)) == []


def test_stubs_that_find_their_engine_killed_remove_its_socket_and_lock(config, tmp_path):
    key, folder = f"test-{uuid.uuid4().hex}", tmp_path / "run"
    first = open_shared(config, key, folder=folder)
    second = open_shared(config, key, folder=folder)
    address, lock_name = shared_address(config, key, folder)
    assert sorted(os.listdir(folder)) == sorted([address.name, lock_name])
    os.kill(first.pid, signal.SIGKILL)  # no chance to remove its socket
    wait_gone(first.pid, "SIGKILL")
    first.close()
    second.close()
    assert os.listdir(folder) == []
