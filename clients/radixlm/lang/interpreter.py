"""``sglang.lang.interpreter``: program states and their executor."""
from ..interpreter import StreamExecutor  # noqa: F401
from ..state import ForkGroup, ProgramState  # noqa: F401

ProgramStateGroup = ForkGroup  # SGLang's name
