"""``sglang.lang.choices``: how ``select`` decides."""
from ..choices import (ChoicesDecision, ChoicesSamplingMethod,  # noqa: F401
                       GreedyTokenSelection, TokenLengthNormalized,
                       UnconditionalLikelihoodNormalized, greedy_token_selection,
                       token_length_normalized, unconditional_likelihood_normalized)
