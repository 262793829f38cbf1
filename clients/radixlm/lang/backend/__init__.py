"""``sglang.lang.backend``: the backends programs run against."""
