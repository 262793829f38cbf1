"""What other threads hand the step loop: typed items, taken all at once each step."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from .groups import Group
from .outputs import StepOutput


@dataclass(frozen=True)
class NewGroup:
    group: Group


@dataclass(frozen=True)
class AbortGroup:
    group_id: str


@dataclass(frozen=True)
class Refusal:
    """A submission refused on its caller's thread: its one output, sent from the loop."""

    output: StepOutput


InboxItem = NewGroup | AbortGroup | Refusal


class Inbox:
    def __init__(self) -> None:
        self._items: list[InboxItem] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()

    def post(self, item: InboxItem) -> None:
        with self._lock:
            self._items.append(item)
        self._wakeup.set()

    def take(self) -> list[InboxItem]:
        with self._lock:
            items, self._items = self._items, []
        return items

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def wait(self, has_work, timeout: float | None) -> bool:
        """Wait until ``has_work()`` or a post or ``wake``; True when there is work."""
        if has_work():
            return True
        self._wakeup.clear()
        if has_work():
            return True
        return self._wakeup.wait(timeout)

    def wake(self) -> None:
        self._wakeup.set()
