"""What radixlm-serve and the image add to tritonserver's command line, unless the command
sets the same thing itself:

* ``--exit-timeout-secs=10``: Triton's wait for in-flight requests on shutdown; the
  supervisor kills tritonserver ``EXIT_MARGIN_S`` after it (``backend.supervisor``), so
  SIGTERM ends tritonserver within exit timeout + margin (13 s by default), and its stubs
  and engine processes within ``Bounds.descendants_s`` more;
* the administrative APIs behind the admin token (``backend.admin_access``), and the
  forwarding of its gRPC header to the models (``debug: stats``);
* the stubs' shared-memory regions named for the supervisor (``radixlm-<pid>-``), so that
  it can find them to make them private and to remove them after a crash.
"""
from __future__ import annotations

import os

from backend.admin_access import (ADMIN_HEADER, GRPC_ADMIN_HEADER, RESTRICTED_APIS,
                                  check_token)
from backend.server_lifecycle import http_base_url, tritonserver_flags
from backend.supervisor import Bounds, ServerPlan, shm_prefix

DEFAULT_EXIT_TIMEOUT_S = 10
EXIT_MARGIN_S = 3
STUB_DEATH_GRACE_ENV = "RADIXLM_STUB_DEATH_GRACE_S"


def has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _shm_prefix_given(args: list[str]) -> bool:
    return any("shm-region-prefix-name" in a for a in args)


def hardened_args(args: list[str], token: str, supervisor_pid: int) -> list[str]:
    """``args`` (tritonserver's, without the program) with our defaults appended."""
    check_token(token)
    apis = ",".join(RESTRICTED_APIS)
    extra = []
    if not has_flag(args, "--exit-timeout-secs"):
        extra.append(f"--exit-timeout-secs={DEFAULT_EXIT_TIMEOUT_S}")
    if not has_flag(args, "--http-restricted-api"):
        extra.append(f"--http-restricted-api={apis}:{ADMIN_HEADER}={token}")
    if not has_flag(args, "--grpc-restricted-protocol"):
        extra.append(f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={token}")
    if not has_flag(args, "--grpc-header-forward-pattern"):
        extra.append(f"--grpc-header-forward-pattern=^({ADMIN_HEADER}|{GRPC_ADMIN_HEADER})$")
    if not _shm_prefix_given(args):
        extra.append(f"--backend-config=python,shm-region-prefix-name="
                     f"{shm_prefix(supervisor_pid)}")
    return list(args) + extra


def bounds_for(args: list[str], environ=None) -> Bounds:
    environ = os.environ if environ is None else environ
    flags = tritonserver_flags(args)
    exit_timeout = float(flags.get("exit-timeout-secs", DEFAULT_EXIT_TIMEOUT_S))
    grace = float(environ.get(STUB_DEATH_GRACE_ENV, "") or Bounds.stub_death_s)
    return Bounds(exit_s=exit_timeout + EXIT_MARGIN_S, stub_death_s=grace)


def server_plan(command: list[str], env: dict[str, str], supervisor_pid: int) -> ServerPlan:
    """The plan for ``command`` (tritonserver and its hardened arguments)."""
    prefix = shm_prefix(supervisor_pid)
    uses_ours = any(f"shm-region-prefix-name={prefix}" in a for a in command)
    return ServerPlan(command=command, env=env, shm_prefix=prefix if uses_ours else None,
                      http_url=http_base_url(command[1:]))
