"""``sglang.test``: helpers SGLang's benchmark scripts import."""
