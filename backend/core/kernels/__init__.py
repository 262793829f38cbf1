"""Triton-language kernels over the paged, token-granular KV pool.

Every kernel reads K/V through ``req_to_token`` (int32 slots) into
``k_buffer/v_buffer[num_slots + 1, num_kv_heads, head_dim]``; slot 0 is the dummy pad
slot, so a masked-off gather that falls back to slot 0 is always in bounds.

Importing this package only decorates the kernels; nothing is compiled until a launch.
Under ``TRITON_INTERPRET=1`` (read when the modules are imported) they run on CPU tensors.
"""
from .decode_attention import (DecodeRope, SharedPrefix, decode_attention,
                               decode_workspace_numel)
from .extend_attention import ExtendTiles, extend_attention, extend_tiles, extend_warmup_lens
from .kv_store import store_kv

__all__ = ["store_kv", "extend_attention", "extend_tiles", "extend_warmup_lens", "ExtendTiles",
           "decode_attention", "decode_workspace_numel",
           "DecodeRope", "SharedPrefix"]
