"""``sglang.lang.backend.runtime_endpoint``."""
from ...endpoint import RuntimeEndpoint  # noqa: F401
