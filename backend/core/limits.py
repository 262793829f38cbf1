"""Server-side bounds on what one request may ask for, set in the model config
(``EngineConfig``'s ``max_*`` request fields). A request beyond one is refused with an
error naming the bound and the config key that sets it; nothing is cut silently."""
from __future__ import annotations

from dataclasses import dataclass

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_tokens: int = 16384  # the largest max_tokens (config: max_tokens_limit)
    max_n: int = 64  # n, and best_of
    max_choices: int = 256  # choices of one scoring request
    max_stop_strings: int = 64  # entries of stop, of stop_regex, of bad_words (each)
    max_stop_string_chars: int = 1024  # length of one of them
    max_prompt_logprobs_tokens: int = 2048  # prompt positions with logprobs per request
    max_prompt_tokens: int | None = None  # None: the context length decides

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError naming the first bound ``params`` exceeds."""
        _at_most("max_tokens", params.max_new_tokens, self.max_tokens, "max_tokens_limit")
        _at_most("n", params.n, self.max_n, "max_n")
        if params.best_of is not None:
            _at_most("best_of", params.best_of, self.max_n, "max_n")
        for key in ("stop", "stop_regex", "bad_words"):
            values = getattr(params, key) or []
            _at_most(f"the number of {key} entries", len(values), self.max_stop_strings,
                     "max_stop_strings")
            longest = max(map(len, values), default=0)
            _at_most(f"the length of a {key} entry", longest, self.max_stop_string_chars,
                     "max_stop_string_chars")

    def check_choices(self, choices: list) -> None:
        _at_most("the number of choices", len(choices), self.max_choices, "max_choices")

    def check_prompt(self, num_tokens: int, params: SamplingParams | None = None) -> None:
        """The prompt's length, and how many of its positions ask for logprobs."""
        if self.max_prompt_tokens is not None:
            _at_most("the prompt's length in tokens", num_tokens, self.max_prompt_tokens,
                     "max_prompt_tokens")
        if params is not None and params.prompt_logprobs is not None:
            asked = num_tokens - min(params.logprob_start_len, num_tokens)
            if asked > self.max_prompt_logprobs_tokens:
                raise ValueError(
                    f"prompt_logprobs asks for {asked} prompt positions; at most "
                    f"{self.max_prompt_logprobs_tokens} are served per request (config "
                    "max_prompt_logprobs_tokens): set logprob_start_len to start later")


def _at_most(what: str, value: int, bound: int, config_key: str) -> None:
    if value > bound:
        raise ValueError(f"{what} is {value}; this server allows at most {bound} "
                         f"(model config {config_key})")
