"""What a client of a real tritonserver started by radixlm-serve cannot reach: Triton's
administrative APIs and the engine's debug stats without the admin token, and the stubs'
shared memory (where prompts and answers pass) as another user of the host."""
from __future__ import annotations

import os
import subprocess

import pytest
import requests
import tritonclient.grpc as grpcclient

from backend.supervisor import SHM_DIR, shm_prefix
from conftest import ADMIN_HEADERS, ADMIN_PARAMETERS

pytestmark = pytest.mark.server
NOBODY = 65534


def test_administrative_apis_and_debug_stats_need_the_admin_token(triton_server):
    base = f"http://{triton_server.http_url}"
    for method, path in (("GET", "/v2/logging"), ("POST", "/v2/repository/index"),
                         ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/trace/setting")):
        refused = requests.request(method, base + path, timeout=10)
        assert refused.status_code == 403, (path, refused.text)
        assert "radixlm-admin-token" in refused.json()["error"]
        assert requests.request(method, base + path, headers=ADMIN_HEADERS,
                                timeout=10).status_code == 200, path
    changed = requests.post(f"{base}/v2/logging", json={"log_verbose_level": 1}, timeout=10)
    assert changed.status_code == 403
    assert requests.get(base + "/v2/models/llm/config", timeout=10).status_code == 200  # open
    debug = requests.post(f"{base}/v2/models/llm/generate", timeout=30,
                          json={"parameters": {"debug": "stats", "radixlm-admin-token": "no"}})
    assert debug.status_code == 400 and "debug requests are restricted" in debug.json()["error"]
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    with pytest.raises(Exception, match="restricted"):
        client.get_log_settings()
    grpc_header = {"triton-grpc-protocol-radixlm-admin-token": ADMIN_PARAMETERS[
        "radixlm-admin-token"]}
    assert client.get_log_settings(headers=grpc_header) is not None


def stub_regions(server) -> list[str]:
    prefix = shm_prefix(server.process.pid)
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def test_the_stubs_shared_memory_is_private_to_the_servers_user(triton_server):
    regions = stub_regions(triton_server)
    assert regions, "the stubs' regions carry radixlm-serve's prefix"
    for name in regions:
        st = os.stat(SHM_DIR / name, follow_symlinks=False)
        assert (oct(st.st_mode & 0o777), st.st_uid) == ("0o600", os.getuid()), name
    if os.getuid() == 0:  # root reads anything: ask as another user whether it can
        as_nobody = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             "head", "-c", "16", str(SHM_DIR / regions[0])], capture_output=True, text=True)
        assert as_nobody.returncode != 0 and "Permission denied" in as_nobody.stderr


def test_a_client_cannot_register_a_stubs_region_through_the_shared_memory_api(triton_server):
    """Registering a region by name would let a client map the stub's memory into its
    requests' inputs and outputs."""
    [region, *_] = stub_regions(triton_server)
    register = requests.post(
        f"http://{triton_server.http_url}/v2/systemsharedmemory/region/probe/register",
        json={"key": region, "offset": 0, "byte_size": 4096}, timeout=10)
    assert register.status_code == 403 and "radixlm-admin-token" in register.json()["error"]
    status = requests.get(f"http://{triton_server.http_url}/v2/systemsharedmemory/status",
                          headers=ADMIN_HEADERS, timeout=10)
    assert status.json() == []  # nothing was registered
