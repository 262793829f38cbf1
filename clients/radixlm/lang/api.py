"""``sglang.lang.api``."""
from ..api import *  # noqa: F401,F403
from ..api import __all__  # noqa: F401
