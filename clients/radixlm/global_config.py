"""``global_config``: SGLang's settings object; here it only carries the default backend."""
from __future__ import annotations

from .backend import BaseBackend
from .program import get_default_backend, set_default_backend


class GlobalConfig:
    """``global_config.default_backend`` reads and sets ``set_default_backend``'s backend."""

    __slots__ = ()

    @property
    def default_backend(self) -> BaseBackend | None:
        return get_default_backend()

    @default_backend.setter
    def default_backend(self, backend: BaseBackend) -> None:
        set_default_backend(backend)


global_config = GlobalConfig()
