"""MistralForCausalLM: the Llama decoder; a sliding window caps the served context
(see ``registry.context_limit``) so attention never needs to skip old tokens."""
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    qkv_bias = False
