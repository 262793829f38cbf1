"""Qwen2ForCausalLM: the Llama decoder with biased Q/K/V projections."""
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
