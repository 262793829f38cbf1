"""``sglang.lang.ir``: the regex constants and the expression types."""
from ..ir import (REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, REGEX_STRING,  # noqa: F401
                  Concat, Expr, Gen, GenParams, RoleBegin, RoleEnd, Select, SeparateReasoning,
                  Text, VarScopeBegin, VarScopeEnd)
from ..program import Function  # noqa: F401
