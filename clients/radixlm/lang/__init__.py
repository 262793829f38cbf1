"""Module paths of SGLang's frontend (``sglang.lang.*``), for programs that import from them."""
