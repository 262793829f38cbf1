"""Phi3ForCausalLM: the Llama decoder. Its checkpoints already store the fused
``qkv_proj`` and ``gate_up_proj`` that our layers use, so they load as they are; its
LongRoPE ("su") scaling is the rotary table's (``layers/rotary.py``), and a
``sliding_window`` in its config applies to every layer."""
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    qkv_bias = False
