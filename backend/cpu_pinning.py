"""Which CPUs the engine process's step loop runs on (``RADIXLM_ENGINE_CPUS``)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path


CPUS_ENV = "RADIXLM_ENGINE_CPUS"


def parse_cpus(text: str) -> set[int]:
    """CPU numbers from a list like ``"8"``, ``"8,10"`` or ``"8-11,14"``."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{CPUS_ENV}={text!r}: expected auto, none, or CPU numbers "
                             "like 8,10-11")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{CPUS_ENV}={text!r}: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


@dataclass(frozen=True)
class HostCpus:
    """What ``auto`` pinning looks at besides the CPUs this process may use."""

    online: int  # CPUs of the machine
    shared: bool  # under a CPU quota or in Kubernetes: other tenants' processes share them
    visible_gpus: tuple[int, ...] = ()  # CUDA/NVIDIA_VISIBLE_DEVICES as machine ordinals

    @classmethod
    def here(cls) -> "HostCpus":
        return cls(os.cpu_count() or 1, _cpu_quota() or "KUBERNETES_SERVICE_HOST" in os.environ,
                   _visible_gpus())


def _cpu_quota() -> bool:
    """A CFS quota on this process's cgroup (v2 cpu.max, v1 cpu.cfs_quota_us)."""
    own = ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = line[3:].strip().strip("/")
    except OSError:
        pass
    v2 = [f"/sys/fs/cgroup/{own}/cpu.max"] if own else []
    for path in v2 + ["/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"]:
        try:
            first = Path(path).read_text().split()[0]
        except (OSError, IndexError):
            continue
        return first not in ("max", "-1")
    return False


def _visible_gpus() -> tuple[int, ...]:
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        parts = os.environ.get(name, "").replace(" ", "").split(",")
        if parts and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    return ()


def loop_cpus(setting: str, allowed: set[int], device: str,
              host: HostCpus | None = None) -> set[int] | None:
    """The CPUs of the step loop thread for a ``RADIXLM_ENGINE_CPUS`` value: ``none``: no
    pinning; a list: those CPUs; ``auto`` (the default): on a CUDA device, with at least 4
    CPUs to choose from, one CPU of its own, counted down from the highest by GPU, so that
    the engine processes of a machine's GPUs get one each. Within a cpuset of its own
    (fewer CPUs allowed than the machine has) the count goes by the device index; on CPUs
    shared with other tenants (a CPU quota, Kubernetes) without such a cpuset, ``auto``
    does not pin (another pod's engine could pick the same CPU); otherwise it goes by the
    GPU's machine ordinal when the visible devices say it."""
    setting = setting.strip().lower() or "auto"
    if setting == "none":
        return None
    if setting != "auto":
        return parse_cpus(setting)
    if not device.startswith("cuda") or len(allowed) < 4:
        return None
    host = host or HostCpus.here()
    index = int(device.partition(":")[2] or 0)
    if len(allowed) >= host.online:  # the machine's CPUs, not a set of our own
        if host.shared:
            return None
        if index < len(host.visible_gpus):
            index = host.visible_gpus[index]
    ordered = sorted(allowed)
    return {ordered[-1 - index % (len(ordered) - 1)]}


class LoopPinning:
    """The step loop on CPUs of its own, every other thread of the process off them.

    Why: the step loop's host time per step is close to the device's at large batches,
    and its messages wake the stub's reader thread, which the kernel likes to place on
    the waker's CPU; on the H200 host an unpinned child stepped at 2.13 ms against 1.78
    ms pinned (1B, batch 128, 53.5k against 64.2k tokens/s; in-process 63.7k)."""

    def __init__(self) -> None:
        self.loop_cpus: set[int] | None = None
        self.other_cpus: set[int] | None = None  # None: wherever the process may run

    def pin_loop(self, device: str, setting: str | None = None) -> set[int] | None:
        """Keep the calling thread (the step loop) on its CPUs (``RADIXLM_ENGINE_CPUS``,
        see ``loop_cpus``); returns them, None when not pinned."""
        setting = os.environ.get(CPUS_ENV, "") if setting is None else setting
        allowed = os.sched_getaffinity(0)
        try:
            cpus = loop_cpus(setting, allowed, device)
            if cpus is None:
                if device.startswith("cuda") and not setting.strip():
                    logging.info("step loop not pinned (CPUs shared with other tenants, or "
                                 "too few); %s=LIST pins it", CPUS_ENV)
                return None
            os.sched_setaffinity(0, cpus)  # may lie outside the parent's set: the child's own
        except (ValueError, OSError) as exc:
            logging.warning("step loop not pinned: %s", exc)
            return None
        self.loop_cpus, self.other_cpus = cpus, (allowed - cpus) or None
        logging.info("step loop pinned to CPUs %s", sorted(cpus))
        return cpus

    def keep_off_loop(self) -> None:
        """At the start of a thread other than the step loop."""
        if self.other_cpus:
            try:
                os.sched_setaffinity(0, self.other_cpus)
            except OSError:
                pass
