"""How ``select`` turns the choices' token log-probabilities into a decision.

A method is called with keyword arguments, one list entry per choice (in choice order):
``choices``, ``normalized_prompt_logprobs`` (mean token logprob), ``input_token_logprobs``
(the choice's tokens as ``(logprob, token_id, text)``), ``output_token_logprobs`` (empty:
selecting generates nothing) and, when the method asks for them,
``unconditional_token_logprobs`` (the same tokens scored without the program's text).
It returns a ``ChoicesDecision``: the chosen string and the meta info the program sees.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

TokenLogprobs = Sequence[Sequence[Any]]  # per token: (logprob, token_id, text)


@dataclass(frozen=True)
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _first_best(values: Sequence[float]) -> int:
    """Index of the largest value; the earliest one wins a tie."""
    best = 0
    for i, value in enumerate(values):
        if value > values[best]:
            best = i
    return best


def _values(tokens: TokenLogprobs) -> list[float]:
    return [float(t[0]) for t in tokens]


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(self, *, choices: Sequence[str], normalized_prompt_logprobs: Sequence[float],
                 input_token_logprobs: Sequence[TokenLogprobs],
                 output_token_logprobs: Sequence[TokenLogprobs],
                 unconditional_token_logprobs: Sequence[TokenLogprobs] | None = None,
                 ) -> ChoicesDecision: ...

    @staticmethod
    def _meta(normalized, inputs, outputs, **extra) -> dict[str, Any]:
        return {"normalized_prompt_logprobs": list(normalized),
                "input_token_logprobs": list(inputs),
                "output_token_logprobs": list(outputs), **extra}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        best = _first_best(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare the choices token by token, keeping those with the best logprob at each
    position until one is left. A choice shorter than another is padded with its own mean
    logprob, so a prefix of a longer choice competes on its average."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        width = max(len(tokens) for tokens in input_token_logprobs)
        matrix = []
        for tokens in input_token_logprobs:
            values = _values(tokens)
            pad = sum(values) / len(values) if values else float("nan")
            matrix.append(values + [pad] * (width - len(values)))
        remaining = list(range(len(choices)))
        for column in range(width):
            top = max(matrix[i][column] for i in remaining)
            remaining = [i for i in remaining if matrix[i][column] == top]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            greedy_logprob_matrix=matrix))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most, on average, from the program's text: mean of
    (logprob in context - logprob without it). The first token has no context-free
    logprob (None), which counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the choices' "
                             "unconditional token logprobs")
        gains = []
        for choice, tokens, alone in zip(choices, input_token_logprobs,
                                         unconditional_token_logprobs):
            if len(tokens) != len(alone):
                raise ValueError(f"choice {choice!r} has {len(tokens)} tokens in context but "
                                 f"{len(alone)} alone")
            base = [0.0 if t[0] is None else float(t[0]) for t in alone]
            diffs = [lp - b for lp, b in zip(_values(tokens), base)]
            gains.append(sum(diffs) / len(diffs))
        best = _first_best(gains)
        return ChoicesDecision(choices[best], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=list(unconditional_token_logprobs),
            normalized_unconditional_prompt_logprobs=gains))


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
