"""``sglang.lang.backend.base_backend``."""
from ...backend import BaseBackend  # noqa: F401
