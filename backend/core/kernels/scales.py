"""What the kernels that read or write a float8 KV pool share: the argument check and
the clamp before a cast to float8. Their divisions by a scale are ``tl.math.div_rn``
(IEEE round-to-nearest, as torch divides), not the default approximate division, so a
kernel stores the very bytes ``KVPool.store`` stores."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def saturate(x):
    """x clamped to the float8 e4m3 range (+-448) before a cast to it: past the range
    the hardware conversion may give NaN, a clamped value is only too small."""
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


def check_kv_scales(k_buffer: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> bool:
    """Whether the pool is float8; if so, its per-head scales must be given."""
    if k_buffer.dtype != torch.float8_e4m3fn:
        return False
    num_kv_heads = k_buffer.shape[1]
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert t is not None, f"a float8 KV pool needs {name}"
        assert t.shape == (num_kv_heads,) and t.dtype == torch.float32 and t.stride(0) == 1
    return True
