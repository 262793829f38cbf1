"""MistralForCausalLM: the Llama decoder; a ``sliding_window`` in its config applies to
every layer (the attention backend attends within it)."""
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    qkv_bias = False
