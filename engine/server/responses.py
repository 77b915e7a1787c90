"""The bodies this server answers with, as pydantic models: `/openapi.json` documents each
endpoint's responses with them (engine.server.openapi), and tests check every answer against that
document. The handlers build plain dicts (the streaming path writes them as they come); these
models describe those dicts, field for field: a field the server sends and these do not list is
an error (extra="forbid"), so the document cannot drift from the answers unnoticed.

Nullable fields are present with null where OpenAI's schemas require them (a chat message's
`refusal`, a choice's `logprobs`), as vLLM sends them. vLLM's extensions of a choice
(stop_reason, token ids, a completion's prompt_logprobs) are present in an answer, null when
unused, as vLLM's are; in a completion's stream, stop_reason, prompt_token_ids and token_ids are
on every chunk (null when unused), in a chat's stream they come only when set (stop_reason on a
choice's last chunk)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "abort"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------ errors
class ErrorDetail(_Body):
    message: str
    type: str = Field(description="invalid_request_error, server_error or server_overloaded_error")
    param: str | None = Field(description="the request field at fault, e.g. messages[0].content")
    code: str | None


class ErrorResponse(_Body):
    error: ErrorDetail


# ------------------------------------------------------------------ shared parts
class PromptTokensDetails(_Body):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")
    created_cache_tokens: int | None = Field(None, description="vLLM's: prompt tokens this request wrote to "
                                             "the prefix cache (its full blocks not read from it)")


class CompletionTokensDetails(_Body):
    reasoning_tokens: int = Field(description="generated tokens of the reasoning (with a reasoning parser)")


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class RequestMetrics(_Body):
    """vLLM's per-request metrics (--enable-per-request-metrics), in ms; a value whose times are
    missing (mean ITL of a one-token reply) is left out."""
    time_to_first_token_ms: float | None = Field(None, description="first scheduled to first token")
    generation_time_ms: float | None = Field(None, description="first token to last token")
    queue_time_ms: float | None = Field(None, description="arrival to first scheduled")
    mean_itl_ms: float | None = Field(None, description="generation time over the tokens after the first")
    tokens_per_second: float | None = Field(None, description="tokens over first scheduled to last token")


class PromptLogprob(_Body):
    """vLLM's prompt_logprobs entry: one token of a prompt position, with its rank."""
    logprob: float
    rank: int
    decoded_token: str


# A choice's prompt_logprobs (vLLM): null for the first prompt token, then per position the prompt
# token and the asked-for alternatives, keyed by token id (as a string).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _Extensions(_Body):
    stop_reason: int | str | None = Field(None, description="the stop string or token id that ended the "
                                                              "choice (vLLM); null otherwise")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with prompt_logprobs (or echo with logprobs)")
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the generated token ids")


# ------------------------------------------------------------------ completions
class PackedTopLogprobs(_Body):
    """vLLM's packed_top_logprobs: the alternatives of each token as raw little-endian row-major
    arrays, base64-encoded (no header)."""
    shape: list[int] = Field(description="[tokens, logprobs]")
    token_ids_dtype: Literal["<i4"]
    logprobs_dtype: Literal["<f4"]
    token_ids_b64: str
    logprobs_b64: str


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(description="the sampled token and the asked-for "
                                                                      "alternatives, per position (empty with "
                                                                      "packed_top_logprobs)")
    text_offset: list[int]
    packed_top_logprobs: PackedTopLogprobs | None = Field(None, description="with packed_top_logprobs (vLLM)")


class CompletionChoice(_Extensions):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    service_tier: None = Field(None, description="always null (OpenAI's field, as vLLM sends it)")
    system_fingerprint: str | None = Field(None, description="the server's configuration (vLLM's "
                                                                "--fingerprint-mode; left out with none)")
    usage: Usage
    metrics: RequestMetrics | None = Field(None, description="with --enable-per-request-metrics, one choice")


class CompletionChunkChoice(CompletionChoice):
    finish_reason: FinishReason | None


class CompletionChunk(_Body):
    """One `data:` event of a streamed completion (the stream ends with `data: [DONE]`)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: on the last chunk "
                                                   "(and on every chunk with continuous_usage_stats)")
    metrics: RequestMetrics | None = Field(None, description="with --enable-per-request-metrics: on the usage "
                                                             "chunk of a stream with one choice")


# ------------------------------------------------------------------ chat
class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob] | None
    refusal: None = Field(description="always null (OpenAI's schema requires the field)")


class ChatMessageOut(_Body):
    role: Literal["assistant"]
    content: str | None
    refusal: None = Field(description="always null: this server never refuses by policy")
    tool_calls: list[dict] = Field(description="always empty: tools are not supported")
    reasoning: str | None = Field(None, description="vLLM's: the reply's thinking, with --reasoning-parser "
                                                    "(null without one, or with include_reasoning false)")


class ChatChoice(_Extensions):
    """(prompt_logprobs and prompt_token_ids: on the response, as vLLM; on each choice only for a
    batch of several conversations, /v1/chat/completions/batch, each choice its conversation's)"""
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids, in a batch of "
                                                                 "conversations: this choice's conversation's")


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    service_tier: None = Field(None, description="always null (OpenAI's field, as vLLM sends it)")
    system_fingerprint: str | None = Field(None, description="the server's configuration (vLLM's "
                                                                "--fingerprint-mode; left out with none)")
    usage: Usage
    metrics: RequestMetrics | None = Field(None, description="with --enable-per-request-metrics, one choice")
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids (vLLM)")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="with prompt_logprobs (vLLM): the prompt's, "
                                                                     "as a completion choice's")


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = Field(None, description="vLLM's: new thinking text, with --reasoning-parser")


class ChatChunkChoice(_Extensions):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Body):
    """One `data:` event of a streamed chat completion (the stream ends with `data: [DONE]`)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids: on the first chunk "
                                                                 "only (vLLM)")
    usage: Usage | None = Field(None, description="with stream_options.include_usage: on the last chunk "
                                                   "(and on every chunk with continuous_usage_stats)")
    metrics: RequestMetrics | None = Field(None, description="with --enable-per-request-metrics: on the usage "
                                                             "chunk of a stream with one choice")


# ------------------------------------------------------------------ models, tokenizer, health
class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Body):
    prompt: str


class Health(_Body):
    status: Literal["ok"]


class HealthError(_Body):
    status: Literal["error"]
    error: str


class IsSleeping(_Body):
    is_sleeping: bool


class Version(_Body):
    version: str
