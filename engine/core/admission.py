"""Whether a request of a given size may be queued, and with how many output tokens: one rule for
the scheduler, the engine and the server.

    prompt of 0 tokens                          refused everywhere
    prompt longer than max_model_len            refused everywhere
    prompt + max_tokens > max_model_len         refused by the OpenAI server (vLLM's server
                                                answers 400 "max_tokens is too large"); truncated
                                                to max_model_len - prompt by the engine core
                                                (scheduler, offline engine, simulator), as vLLM's
                                                engine core does: the request finishes with
                                                "length" after fewer tokens than it asked for, and
                                                its record keeps both counts
    prompt == max_model_len                     the truncated case at its limit: one token, whose
                                                KV is never needed (refused by the server, whose
                                                prompt + max_tokens is always > max_model_len)
    max_tokens None                             "as many as fit": max_model_len - prompt (at least 1),
                                                or `default_max_tokens` where the caller has one
                                                (completions: 16), then checked as if given
"""
from __future__ import annotations


class AdmissionError(ValueError):
    """A request that must not be queued; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def admit(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, refuse_overflow: bool,
          max_tokens_field: str = "max_tokens", prompt_field: str = "prompt",
          default_max_tokens: int | None = None) -> int:
    """The number of output tokens the request runs with (<= max_tokens), or AdmissionError.

    refuse_overflow: the server's rule (prompt + max_tokens must fit); False: the engine core's
    (truncate to what fits). The *_field names are the request's own (e.g. "messages")."""
    n, pf = num_prompt_tokens, prompt_field
    if n <= 0:
        raise AdmissionError(pf, f"{pf}: the decoder prompt cannot be empty (0 tokens): a "
                                 "request needs at least one prompt token")
    if n > max_model_len:
        raise AdmissionError(pf, f"{pf}: {n} tokens is longer than max_model_len={max_model_len}")
    room = max_model_len - n
    if max_tokens is None:
        if refuse_overflow and room < 1:
            raise AdmissionError(pf, f"{pf}: {n} tokens leaves no room for a generated token in "
                                     f"max_model_len={max_model_len}")
        if default_max_tokens is None:
            return max(1, room)
        max_tokens = default_max_tokens
    if max_tokens < 1:
        raise AdmissionError(max_tokens_field, f"{max_tokens_field}={max_tokens}: must be >= 1")
    if n + max_tokens > max_model_len:
        if refuse_overflow:
            raise AdmissionError(max_tokens_field, f"{max_tokens_field}={max_tokens}: prompt ({n} tokens) + "
                                                   f"{max_tokens_field} exceeds max_model_len={max_model_len}")
        return max(1, room)
    return max_tokens
