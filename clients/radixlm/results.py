"""Small result types shared by the client, the language backends and the wire codec."""
from __future__ import annotations

from typing import Any, NamedTuple


class Chunk(NamedTuple):
    """One response of a generation request: the new text of one engine step for one sample."""

    text: str
    index: int = 0  # sample index when n > 1
    output_ids: tuple[int, ...] = ()
    finish_reason: str = ""  # "" until this sample's last chunk
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # this chunk's tokens (streamed: the new ones only)
    num_cached_tokens: int = 0
    logprobs: Any = None  # the server's logprobs JSON of this chunk's tokens
    prompt_logprobs: Any = None  # the prompt's, when asked (prompt_logprobs)
    prompt_text: str | None = None  # the prompt as text, when asked (first response only)

    @property
    def says_something(self) -> bool:
        """False for a sample's entry that only repeats it is still running (a response
        of n > 1 samples holds one for every sample)."""
        return bool(self.text or self.output_ids or self.finish_reason
                    or self.prompt_text is not None or self.prompt_logprobs is not None)


class GenerateResult(NamedTuple):
    """The whole output of one sample; ``samples`` holds all of them when n > 1."""

    text: str
    finish_reason: str
    output_ids: tuple[int, ...] = ()
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0
    logprobs: list | None = None
    samples: tuple["GenerateResult", ...] = ()
    prompt_logprobs: list | None = None


class ChoiceScore(NamedTuple):
    """Log-probability of one choice's tokens following the prompt."""

    choice: str
    logprob_sum: float
    num_tokens: int
    normalized_logprob: float  # logprob_sum / num_tokens
    token_logprobs: tuple[float, ...] = ()
    token_ids: tuple[int, ...] = ()  # the choice's tokens, when the server sends them


class ScoreResult(NamedTuple):
    """All choices' scores, in the order the choices were given."""

    scores: tuple[ChoiceScore, ...]
    num_input_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def best(self) -> ChoiceScore:
        """Highest length-normalized log-probability; the first one wins a tie."""
        return max(self.scores, key=lambda s: s.normalized_logprob)


def merge_chunks(chunks: list[Chunk]) -> GenerateResult:
    """Fold the chunks of one request into per-sample results (sample 0 on top)."""
    by_index: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    if not by_index:
        return GenerateResult(text="", finish_reason="abort")
    samples = []
    for index in sorted(by_index):
        parts = by_index[index]
        logprobs = [lp for c in parts if c.logprobs for lp in
                    (c.logprobs if isinstance(c.logprobs, list) else [c.logprobs])]
        samples.append(GenerateResult(
            text="".join(c.text for c in parts),
            finish_reason=next((c.finish_reason for c in reversed(parts) if c.finish_reason),
                               "abort"),
            output_ids=tuple(t for c in parts for t in c.output_ids),
            num_input_tokens=max(c.num_input_tokens for c in parts),
            num_output_tokens=sum(c.num_output_tokens for c in parts),
            num_cached_tokens=max(c.num_cached_tokens for c in parts),
            index=index,
            logprobs=logprobs or None,
            prompt_logprobs=next((c.prompt_logprobs for c in chunks
                                  if c.prompt_logprobs is not None), None),
        ))
    return samples[0]._replace(samples=tuple(samples) if len(samples) > 1 else ())
