"""OpenAI-compatible request bodies, their validation, and error responses.

Validation is strict: a field of the wrong JSON type is refused, never coerced ("5" is not 5,
"yes" is not true, 1.5 is not an integer, Infinity and NaN are not numbers; 1.0 is the integer 1,
as in JSON Schema; as vLLM's lax parsing, a boolean field takes "true" and "false", and a
how-many-logprobs field true and false as 1 and 0), integers are bounded to 64 bits, and every
string must be valid Unicode (no lone surrogates). Fields OpenAI or vLLM define that this server
does not implement are refused with a 400 naming them, unless they hold the value that means
"off" (UNSUPPORTED). Unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

import functools
import json
import time
import types
import uuid
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator,
                      model_validator)

from engine.core.sampling_params import MAX_LOGPROBS, SamplingParams

I64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
MAX_JSON_DEPTH = 32
MAX_N = 128
# logprobs / top_logprobs / prompt_logprobs: how many alternatives, -1 for the whole vocabulary (as
# vLLM); the server's max_logprobs bounds them (ServerContext.parse), MAX_LOGPROBS by default
LogprobCount = Annotated[int, Field(ge=-1, le=(1 << 63) - 1)]

# Fields checked by hand (to name the bad element), documented in /openapi.json as they are checked.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
StopField = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                                                     {"type": "null"}], "default": None})]
PromptField = Annotated[Any, WithJsonSchema({
    "anyOf": [{"type": "string"}, _TOKEN_IDS,
              {"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]}}],
    "description": "a text, a list of token ids, or a list of either (one completion each)"})]
EmbedsField = Annotated[Any, WithJsonSchema({
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}],
    "default": None,
    "description": "prompts given as vectors (servers started with --enable-prompt-embeds): each the base64 "
                   "of a torch.save'd (num_tokens, hidden_size) floating-point tensor; prompt may then be "
                   "null"})]
ContentField = Annotated[Any, WithJsonSchema({
    "anyOf": [{"type": "string"}, {"type": "null"},
              {"type": "array", "items": {"anyOf": [
                  {"type": "object", "required": ["type", "text"],
                   "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
                  {"type": "object", "required": ["type", "data"],
                   "properties": {"type": {"const": "prompt_embeds"}, "data": {"type": "string"}}}]}}],
    "default": None,
    "description": "a text, or a list of text parts (and, on a server started with --enable-prompt-embeds, "
                   "prompt_embeds parts: the base64 of a torch.save'd (num_tokens, hidden_size) tensor)"})]


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, and the offending field (param)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# ------------------------------------------------------------------ raw JSON
def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads(body: bytes) -> Any:
    """Parse a request body; APIError(400, param "body") for anything that is not strict JSON
    (invalid UTF-8, NaN/Infinity, nesting deeper than the parser allows)."""
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(400, "body: JSON nested too deeply", "body") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"body: request body is not valid JSON: {e}", "body") from None


def path_name(loc) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def check_json_values(obj: Any) -> None:
    """Every string valid Unicode, nesting at most MAX_JSON_DEPTH; APIError naming the field."""
    stack = [(obj, (), 0)]
    while stack:
        x, loc, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            top = path_name(loc[:1])
            raise APIError(400, f"{top}: nested deeper than {MAX_JSON_DEPTH} levels", top)
        if isinstance(x, str):
            _check_str(x, loc)
        elif isinstance(x, dict):
            for k, v in x.items():
                _check_str(k, loc + (k,))
                stack.append((v, loc + (k,), depth + 1))
        elif isinstance(x, list):
            stack.extend((v, loc + (i,), depth + 1) for i, v in enumerate(x))


def _check_str(s: str, loc) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        name = path_name(loc)
        raise APIError(400, f"{name}: not valid Unicode ({e.reason} at character {e.start}: "
                            f"{s[e.start]!r})", name) from None


# Fields defined by OpenAI or vLLM that this server does not implement -> the values that mean
# "not used" (a callable decides). Anything else gets a 400 naming the field. (OpenAI's
# `prediction`, a speed hint that changes no output, is ignored as vLLM ignores it.)
def _off(*values):
    return lambda v: v in values


UNSUPPORTED = {
    "tools": _off(None, []),
    "tool_choice": _off(None, "none"),
    "functions": _off(None, []),
    "function_call": _off(None, "none"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "suffix": _off(None, ""),
    "guided_json": _off(None),
    "guided_regex": _off(None),
    "guided_choice": _off(None),
    "guided_grammar": _off(None),
    "structured_outputs": _off(None),
    "audio": _off(None),
    "modalities": lambda v: v is None or v == ["text"],
    "skip_special_tokens": _off(None, True),
    "use_beam_search": _off(None, False),
    "logits_processors": _off(None, []),
    "bad_words": _off(None, []),
    "documents": _off(None, []),
    "length_penalty": _off(None, 1.0, 1),
    # vLLM's KV-connector parameters: without a connector they mean nothing and are ignored, as
    # vLLM ignores them; the one that asks for an output (the prompt's last hidden state) is refused
    "kv_transfer_params": lambda v: not (isinstance(v, dict) and v.get("return_last_hidden_state")),
}


def check_unsupported(body: dict) -> None:
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        # a malformed request before an unsupported one (vLLM's words: its validation says so first)
        raise APIError(400, f"response_format={_short(fmt)}: response_format.json_schema must be provided "
                            "when response_format.type is 'json_schema'", "response_format.json_schema")
    for name, is_off in UNSUPPORTED.items():
        if name in body and not is_off(body[name]):
            raise APIError(400, f"{name}={_short(body[name])}: not supported by this server", name)
    n = 1 if body.get("n") is None else body["n"]
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of={_short(best_of)}: not supported by this server (only best_of == n)",
                       "best_of")


def _short(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


# ------------------------------------------------------------------ models
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _lax_json_scalars(cls, data: Any) -> Any:
        """A boolean field also takes the strings "true" and "false" (vLLM's lax parsing takes
        them, and its own tests send `"logprobs": "true"`); any other string or a number stays a
        type error naming the field. An integer field, or a list of integers, takes a number
        without a fractional part (`1.0`), which JSON Schema's "integer" includes and vLLM takes."""
        if isinstance(data, dict):
            for name in _bool_fields(cls):
                if data.get(name) in ("true", "false"):
                    data = {**data, name: data[name] == "true"}
            for name in _COUNT_FIELDS.intersection(_int_fields(cls)):
                if isinstance(data.get(name), bool):  # vLLM's lax parsing: true is 1, false 0
                    data = {**data, name: int(data[name])}
            for name in _int_fields(cls):
                v = data.get(name)
                if _integral(v):
                    data = {**data, name: int(v)}
                elif isinstance(v, list) and any(_integral(x) for x in v):
                    data = {**data, name: [int(x) if _integral(x) else x for x in v]}
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        """The schema says what _lax_json_scalars takes: a boolean field also "true" or "false"."""
        js = handler(core_schema)
        props = handler.resolve_ref_schema(js).get("properties", {})
        for name in _COUNT_FIELDS.intersection(_int_fields(cls)):
            prop = props.get(name)
            if prop is not None and {"type": "boolean"} not in prop.get("anyOf", [{"type": "boolean"}]):
                prop["anyOf"].insert(1, {"type": "boolean"})
        for name in _bool_fields(cls):
            prop = props.get(name)
            if prop is None:
                continue
            if prop.get("type") == "boolean":
                del prop["type"]
                prop["anyOf"] = [{"type": "boolean"}, _BOOL_STRINGS]
            elif {"type": "boolean"} in prop.get("anyOf", []) and _BOOL_STRINGS not in prop["anyOf"]:
                i = prop["anyOf"].index({"type": "boolean"})
                prop["anyOf"].insert(i + 1, dict(_BOOL_STRINGS))
        return js


_BOOL_STRINGS = {"type": "string", "enum": ["true", "false"]}
# how-many-logprobs fields that also take a boolean, as vLLM's lax parsing does (its own tests send
# `"prompt_logprobs": true`): true is 1, false 0
_COUNT_FIELDS = frozenset({"prompt_logprobs", "logprobs", "top_logprobs"})


def _integral(v: Any) -> bool:
    """A float with no fractional part, small enough to be exact (|v| < 2**53)."""
    return isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53


def _has_int(annotation: Any) -> bool:
    """int is in the annotation: int, Annotated[int, ...], list[int], int | None, ..."""
    if annotation is int:
        return True
    return any(_has_int(a) for a in get_args(annotation) if a is not bool)


@functools.cache
def _int_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model` whose type holds an integer (int, list[int], optional or bounded)."""
    return tuple(name for name, f in model.model_fields.items() if _has_int(f.annotation))


@functools.cache
def _bool_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model` typed bool or bool | None."""
    return tuple(name for name, f in model.model_fields.items()
                 if f.annotation is bool or (get_origin(f.annotation) in (Union, types.UnionType)
                                             and set(get_args(f.annotation)) <= {bool, type(None)}))


class StreamOptions(_Strict):
    include_usage: bool | None = False           # null: false (vLLM's fields are optional)
    continuous_usage_stats: bool | None = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: I64 | None = Field(None, json_schema_extra={"minimum": 0})
    max_completion_tokens: I64 | None = Field(None, json_schema_extra={"minimum": 1})
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: I64 | None = Field(None, json_schema_extra={"minimum": -1})
    min_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})  # vLLM's
    # vLLM's extensions: only these tokens may be sampled; the prompt cut to its last k tokens
    # (-1: to max_model_len)
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=(1 << 63) - 1)]] | None = Field(None, min_length=1)
    # vLLM's: the alternatives reported with each sampled token are these ids' logprobs (needs logprobs)
    logprob_token_ids: list[Annotated[int, Field(ge=0, le=(1 << 63) - 1)]] | None = Field(None, min_length=1)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=(1 << 63) - 1)] | None = None
    # vLLM's: which end truncate_prompt_tokens cuts ("left", the default: keep the last tokens;
    # "right": keep the first)
    truncation_side: Literal["left", "right"] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1   # null: 1 (OpenAI's field is nullable)
    best_of: I64 | None = None
    stop: StopField = None            # str | list[str] | None, checked in stop_strings()
    stop_token_ids: list[Annotated[int, Field(ge=0, le=(1 << 63) - 1)]] | None = None
    seed: I64 | None = None           # vLLM's range: a signed 64-bit integer (torch.long)
    presence_penalty: float | None = Field(None, json_schema_extra={"minimum": -2, "maximum": 2})
    frequency_penalty: float | None = Field(None, json_schema_extra={"minimum": -2, "maximum": 2})
    repetition_penalty: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0})
    min_tokens: Annotated[int, Field(ge=0, le=(1 << 63) - 1)] = 0
    # vLLM's: EOS and stop ids masked, stop strings ignored, until the text has this many characters
    min_characters: Annotated[int, Field(ge=0, le=(1 << 63) - 1)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: I64 = 0
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt (one per
    # tenant, so one cannot time another's cached prompts)
    cache_salt: str | None = Field(None, min_length=1)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})  # token id (as a string, as OpenAI's JSON) -> bias
    # vLLM's extension: each prompt token's logprob and this many alternatives (choice.prompt_logprobs)
    prompt_logprobs: LogprobCount | None = None
    # vLLM's extensions: the prompt's and the output's token ids in the response; logprob tokens
    # written "token_id:ID" (for tokens that do not decode to text on their own)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: after the reasoning start marker at most this many tokens before the end marker is
    # forced (a server with --reasoning-parser; -1 or null: no limit)
    thinking_token_budget: I64 | None = None
    # max_tokens when the request gives none (None: as many as fit); see engine.core.admission
    default_max_tokens: ClassVar[int | None] = None

    @field_validator("thinking_token_budget", mode="before")
    @classmethod
    def _budget(cls, v):
        """vLLM's thinking_token_budget: an integer >= 0, or -1 (or null) for no limit."""
        if v is None or v == -1 and not isinstance(v, bool):
            return None
        if isinstance(v, bool) or not _is_int(v) or v < 0:
            raise APIError(400, f"thinking_token_budget={_short(v)}: `thinking_token_budget` must be a "
                                "non-negative integer or -1 for unlimited.", "thinking_token_budget")
        return int(v)

    @model_validator(mode="before")
    @classmethod
    def _empty_logprob_ids(cls, data: Any) -> Any:
        """An empty logprob_token_ids is a 400 in vLLM's words (not pydantic's too_short)."""
        if isinstance(data, dict) and data.get("logprob_token_ids") == []:
            raise APIError(400, "logprob_token_ids=[]: must not be an empty list (leave it out, or give "
                                "the token ids whose log-probabilities to report)", "logprob_token_ids")
        return data

    @field_validator("n")
    @classmethod
    def _null_n_is_one(cls, v: int | None) -> int:
        return 1 if v is None else v

    @model_validator(mode="after")
    def _no_prompt_logprobs_on_a_stream(self):
        """vLLM's: a stream carries no prompt logprobs (0, the prompt tokens' own logprobs without
        alternatives, is allowed), checked before any limit on how many."""
        k = self.prompt_logprobs
        if self.stream and k is not None and (k > 0 or k == -1):
            raise APIError(400, f"prompt_logprobs={k}: `prompt_logprobs` are not available when `stream=True`.",
                           "prompt_logprobs")
        return self

    def stop_strings(self) -> list[str]:
        s = self.stop
        if s is None:
            return []
        if isinstance(s, str):
            return [s]
        if isinstance(s, list) and all(isinstance(x, str) for x in s):
            return list(s)
        raise APIError(400, f"stop={_short(s)}: must be a string or a list of strings", "stop")

    def token_biases(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with integer keys, each a token id in [0, vocab_size), or a 400 naming it."""
        if not self.logit_bias:
            return None
        out = {}
        bad = []
        for k, v in self.logit_bias.items():
            try:
                t = int(k)
            except ValueError:
                bad.append(k)
                continue
            if not 0 <= t < vocab_size:
                raise APIError(400, f"logit_bias: token id {t} is out-of-vocab (out of vocabulary: not in "
                                    f"[0, {vocab_size}); vocabulary size: {vocab_size})", "logit_bias")
            out[t] = v
        if bad:  # every bad key at once, as vLLM
            keys = ", ".join(_short(k) for k in bad[:20]) + (f" (and {len(bad) - 20} more)" if len(bad) > 20 else "")
            raise APIError(400, f"logit_bias: key{'s' if len(bad) > 1 else ''} {keys} "
                                f"{'are not token ids' if len(bad) > 1 else 'is not a token id'}", "logit_bias")
        return out

    def check_allowed_ids(self, vocab_size: int) -> None:
        """allowed_token_ids, stop_token_ids and logprob_token_ids within the vocabulary, or a 400
        naming the field."""
        token_ids(self.allowed_token_ids or [], vocab_size, "allowed_token_ids")
        token_ids(self.stop_token_ids or [], vocab_size, "stop_token_ids")
        token_ids(self.logprob_token_ids or [], vocab_size, "logprob_token_ids")

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's ids cut to truncate_prompt_tokens (-1: max_model_len), as vLLM: its last
        ones, or its first ones with truncation_side "right"."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k > max_model_len:
            raise APIError(400, f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                                f"({max_model_len}). Please, select a smaller truncation size.",
                           "truncate_prompt_tokens")
        k = max_model_len if k == -1 else k
        if not k or len(ids) <= k:
            return ids
        return ids[:k] if self.truncation_side == "right" else ids[-k:]

    def wanted_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprob comes with, or None (not asked)."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, seed: int | None, logprobs: int | None,
                        logit_bias: dict[int, float] | None = None, reasoning=None) -> SamplingParams:
        """Raises APIError(400) naming the field for invalid values. `reasoning`: the server's
        reasoning parser (engine.server.reasoning), whose markers a thinking_token_budget counts."""
        def d(v, default):
            return default if v is None else v
        budget = {}
        if self.thinking_token_budget is not None:
            if reasoning is None:
                raise APIError(400, f"thinking_token_budget={self.thinking_token_budget}: needs a server started "
                                    "with --reasoning-parser", "thinking_token_budget")
            budget = {"thinking_token_budget": self.thinking_token_budget,
                      "reasoning_start_ids": reasoning.start_ids, "reasoning_end_ids": reasoning.end_ids}
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=self.min_tokens, min_characters=self.min_characters,
                ignore_eos=self.ignore_eos,
                stop_token_ids=list(self.stop_token_ids or []), stop=self.stop_strings(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                temperature=d(self.temperature, 1.0), top_p=d(self.top_p, 1.0), top_k=d(self.top_k, 0),
                seed=seed, presence_penalty=d(self.presence_penalty, 0.0),
                frequency_penalty=d(self.frequency_penalty, 0.0),
                repetition_penalty=d(self.repetition_penalty, 1.0), logprobs=logprobs, logit_bias=logit_bias,
                prompt_logprobs=self.wanted_prompt_logprobs(), min_p=d(self.min_p, 0.0),
                allowed_token_ids=self.allowed_token_ids, logprob_token_ids=self.logprob_token_ids,
                max_logprobs=-1, **budget)  # bounded by the server
        except ValueError as e:
            msg = str(e)
            field = msg.split("SamplingParams.", 1)[-1].split("=", 1)[0] if "SamplingParams." in msg else None
            raise APIError(400, msg.replace("SamplingParams.", ""), field) from None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _required(js: dict, name: str) -> None:
    """Document a field as required that the model checks itself (to answer "NAME: required")."""
    js["required"] = sorted({*js.get("required", ()), name})
    js["properties"][name].pop("default", None)


class CompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra=lambda js: _required(js, "prompt"))
    prompt: PromptField = None        # str | list[int] | list[str] | list[list[int]], see prompts()
    # vLLM's (with --enable-prompt-embeds): each a prompt given as vectors, base64 of a torch.save'd
    # (num_tokens, hidden_size) tensor; they come before the text prompts' choices
    prompt_embeds: EmbedsField = None
    echo: bool | None = False
    logprobs: LogprobCount | None = None
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's and vLLM's completions (chat has none)
    # vLLM's: each generated token's `logprobs` alternatives as two base64 arrays (int32 ids and
    # float32 logprobs, [tokens, logprobs]) instead of a dict per token; see Shape.packed_logprobs
    packed_top_logprobs: bool | None = False

    @model_validator(mode="after")
    def _packed_needs(self):
        """packed_top_logprobs needs logprobs >= 1 and token ids for tokens (a request's
        return_tokens_as_token_ids false is refused here, the server's default in the route), and
        takes neither echo nor logprob_token_ids (vLLM's rules); each a 400."""
        if not self.packed_top_logprobs:
            return self
        why = ("needs logprobs >= 1" if self.logprobs is None or self.logprobs < 1
               else "not with echo" if self.echo
               else "not with logprob_token_ids" if self.logprob_token_ids is not None
               else "needs return_tokens_as_token_ids=true" if self.return_tokens_as_token_ids is False
               else None)
        if why is not None:
            raise APIError(400, f"packed_top_logprobs=true: {why} (logprobs={self.logprobs}, echo={self.echo}, "
                                f"return_tokens_as_token_ids={self.return_tokens_as_token_ids})",
                           "packed_top_logprobs")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated (vLLM's
        echo without generation: one token is generated and dropped)."""
        return bool(self.echo) and self.max_tokens == 0 and self.max_completion_tokens is None

    @property
    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else _Common.requested_max_tokens.fget(self)

    def wanted_prompt_logprobs(self) -> int | None:
        """echo with logprobs reports the prompt tokens' logprobs too (the legacy completions
        format lm-evaluation-harness scores with), at the same number of alternatives."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def embeds_prompts(self) -> list[str]:
        """The prompts given as vectors (prompt_embeds: base64 payloads, not yet decoded), a 400
        naming the field and the combinations vLLM refuses."""
        e = self.prompt_embeds
        if e is None or e == []:
            return []
        items = [e] if isinstance(e, str) else e
        if not isinstance(items, list):
            raise APIError(400, f"prompt_embeds={_short(e)}: must be a base64 string or a list of them",
                           "prompt_embeds")
        for i, x in enumerate(items):
            if not isinstance(x, str) or not x:
                name = "prompt_embeds" if isinstance(e, str) else f"prompt_embeds[{i}]"
                raise APIError(400, f"{name}={_short(x)}: must be a non-empty base64 string", name)
        if self.echo:
            raise APIError(400, "echo: Echo is unsupported with prompt embeds.", "echo")
        if self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs: prompt_logprobs is not compatible with prompt embeds.",
                           "prompt_logprobs")
        return items

    def prompts(self, vocab_size: int) -> list[str | list[int]]:
        """The prompts of this request: texts, or lists of token ids in [0, vocab_size); none
        (prompt null or []) only beside prompt_embeds."""
        p = self.prompt
        if p is None or (isinstance(p, list) and not p):  # vLLM's words
            if self.embeds_prompts():
                return []
            raise APIError(400, "prompt: required. Either prompt or prompt_embeds must be provided and "
                                "non-empty.", "prompt")
        if isinstance(p, str):
            return [p]
        if not isinstance(p, list):
            raise APIError(400, f"prompt={_short(p)}: must be a string, a list of token ids, or a "
                                "non-empty list of either", "prompt")
        if all(_is_int(t) for t in p):
            return [token_ids(p, vocab_size, "prompt")]
        if any(isinstance(t, (int, float)) for t in p):  # meant as token ids, one is not
            i = next(i for i, t in enumerate(p) if not _is_int(t))
            raise APIError(400, f"prompt[{i}]={_short(p[i])}: a token id must be an integer", f"prompt[{i}]")
        out: list[str | list[int]] = []
        for i, q in enumerate(p):
            if isinstance(q, str):
                out.append(q)
            elif isinstance(q, list) and q and all(_is_int(t) for t in q):
                out.append(token_ids(q, vocab_size, f"prompt[{i}]"))
            else:
                raise APIError(400, f"prompt[{i}]={_short(q)}: must be a string or a non-empty list of "
                                    "token ids", f"prompt[{i}]")
        return out


class ChatMessage(_Strict):
    role: Annotated[str, Field(min_length=1)]  # any role the chat template takes (vLLM: custom roles)
    content: ContentField = None      # str | list of content parts | None, see text()
    name: str | None = None

    def _part_texts(self, where: str, slots: "EmbedSlots | None") -> list[str]:
        """Each content part's text (a prompt_embeds part: its marker in `slots`); a 400 naming
        the part that is not a text part (or, without `slots`, a prompt_embeds one)."""
        out = []
        for j, part in enumerate(self.content):
            name = f"{where}.content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise APIError(400, f"{name}={_short(part)}: a content part is an object with a string "
                                    "'type'", name)
            if part["type"] == "prompt_embeds" and slots is not None:
                out.append(slots.marker(name, part.get("data")))
                continue
            if part["type"] != "text":
                raise APIError(400, f"{name}.type={part['type']!r}: only text content parts are supported "
                                    "by this server" + (" (prompt_embeds: in chat and completions only)"
                                                        if part["type"] == "prompt_embeds" else ""),
                               f"{name}.type")
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{name}.text={_short(part.get('text'))}: must be a string",
                               f"{name}.text")
            out.append(part["text"])
        return out

    def text(self, where: str, slots: "EmbedSlots | None" = None) -> str:
        """The message's text; only text content parts are supported, and prompt_embeds parts
        when `slots` collects them (each is its marker in the text)."""
        c = self.content
        if c is None:
            return ""
        if isinstance(c, str):
            return c
        if not isinstance(c, list):
            raise APIError(400, f"{where}.content={_short(c)}: must be a string or a list of content parts",
                           f"{where}.content")
        return "".join(self._part_texts(where, slots))

    def reasoning_text(self, where: str, slots: "EmbedSlots | None" = None) -> str | None:
        """An assistant message's earlier reasoning (vLLM's `reasoning`, or its old name
        `reasoning_content`), which the chat template may render: a string, or a prompt_embeds
        part when `slots` collects them (its marker)."""
        extra = self.model_extra or {}
        value = extra.get("reasoning", extra.get("reasoning_content"))
        if value is None:
            return None
        name = f"{where}.reasoning"
        if isinstance(value, dict) and value.get("type") == "prompt_embeds":
            if slots is None:
                raise APIError(400, f"{name}: prompt_embeds parts are not supported here", name)
            return slots.marker(name, value.get("data"))
        if not isinstance(value, str):
            raise APIError(400, f"{name}={_short(value)}: must be a string", name)
        return value

    def template_turn(self, where: str, parts: bool = False, slots: "EmbedSlots | None" = None) -> dict:
        """The message as the chat template takes it: role, content (template_content) and, for
        the assistant, its earlier reasoning as `reasoning` and `reasoning_content` (as vLLM)."""
        turn = {"role": self.role, "content": self.template_content(where, parts, slots)}
        thought = self.reasoning_text(where, slots)
        if thought is not None and self.role == "assistant":
            turn["reasoning"] = turn["reasoning_content"] = thought
        return turn

    def template_content(self, where: str, parts: bool = False,
                         slots: "EmbedSlots | None" = None) -> str | list[dict]:
        """The content as the chat template takes it: one string, or with `parts` (content format
        "openai") the text parts as sent, their other fields kept (a template may read them, e.g.
        a translation template's language codes), a prompt_embeds part as a text part holding its
        marker; a string content stays a string."""
        text = self.text(where, slots)  # checks the parts
        if not (parts and isinstance(self.content, list)):
            return text
        texts = self._part_texts(where, slots)
        return [dict(p) if p["type"] == "text" else {"type": "text", "text": t}
                for p, t in zip(self.content, texts)]


class EmbedSlots:
    """The prompt_embeds parts of one chat request, in the order met: each stands in the text
    the chat template renders as a marker no text can hold by accident (a random nonce per
    request); the route finds the markers in the rendered prompt (see context.split_markers)."""

    def __init__(self) -> None:
        self.nonce = uuid.uuid4().hex
        self.data: list[str] = []       # each slot's base64 payload
        self.names: list[str] = []      # each slot's field (messages[i].content[j] / .reasoning)
        self._by_name: dict[str, int] = {}

    def marker(self, name: str, data: Any) -> str:
        """The marker of the part at field `name` (the same one each time it is asked), or a 400
        when its `data` is not a base64 string."""
        if name not in self._by_name:
            if not isinstance(data, str) or not data:
                raise APIError(400, f"{name}.data={_short(data)}: a prompt_embeds part needs `data`, the "
                                    "base64 of a torch.save'd (num_tokens, hidden_size) tensor", f"{name}.data")
            self._by_name[name] = len(self.data)
            self.data.append(data)
            self.names.append(name)
        return self.tag(self._by_name[name])

    def tag(self, i: int) -> str:
        return f"<|prompt_embeds:{self.nonce}:{i}|>"


class _ChatFields(_Common):
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's extension: the reply starts with the last message's text when that message has the
    # reply's role (assistant), e.g. a message being continued
    echo: bool | None = False
    # vLLM's: extra variables for the chat template (e.g. enable_thinking), and whether the
    # templated text gets the tokenizer's special tokens too (the template writes its own)
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # vLLM's: the request's own Jinja chat template (with --trust-request-chat-template only)
    chat_template: str | None = None
    # vLLM's: the reply's reasoning (a server with --reasoning-parser) in message.reasoning; false
    # leaves it out (its tokens still count in usage)
    include_reasoning: bool = True

    def conversations(self) -> list[list[ChatMessage]]:
        raise NotImplementedError

    def _where(self, k: int) -> str:
        return "messages"

    def echo_texts(self) -> list[str] | None:
        """Each conversation's echo (its last message's text when that is the assistant's, else
        ""), or None without echo or when no conversation ends with the assistant."""
        if not self.echo:
            return None
        out = []
        for k, msgs in enumerate(self.conversations()):
            last = msgs[-1]
            out.append(last.text(f"{self._where(k)}[{len(msgs) - 1}]") if last.role == "assistant" else "")
        return out if any(m[-1].role == "assistant" for m in self.conversations()) else None

    def chat_turns(self, parts: bool = False, slots: EmbedSlots | None = None) -> list[list[dict]]:
        """Each conversation as the chat template takes it ({role, content} dicts; `parts`: see
        ChatMessage.template_content; `slots`: collects prompt_embeds parts, else they are a 400)."""
        out = []
        for k, msgs in enumerate(self.conversations()):
            where = self._where(k)
            for i, m in enumerate(msgs):
                if m.model_extra and m.model_extra.get("tool_calls"):
                    raise APIError(400, f"{where}[{i}].tool_calls: not supported by this server",
                                   f"{where}[{i}].tool_calls")
            out.append([m.template_turn(f"{where}[{i}]", parts, slots) for i, m in enumerate(msgs)])
        return out


class ChatCompletionRequest(_ChatFields):
    # at least one message, unless prompt_token_ids are given (then none)
    messages: list[ChatMessage]
    # vLLM's token-in chat: the templated conversation's token ids (e.g. from POST /tokenize with
    # the messages), generated from as they are; the reply is text as usual
    prompt_token_ids: list[Annotated[int, Field(ge=0, le=(1 << 63) - 1)]] | None = Field(None, min_length=1)

    # the template's options: none of them applies to prompt_token_ids
    TEMPLATE_OPTIONS: ClassVar[tuple[str, ...]] = ("add_generation_prompt", "continue_final_message",
                                                   "chat_template_kwargs", "add_special_tokens", "echo",
                                                   "chat_template")

    def token_in(self, vocab_size: int) -> list[int] | None:
        """prompt_token_ids checked (or None), or a 400 naming what conflicts with them."""
        if self.prompt_token_ids is None:
            if not self.messages:
                raise APIError(400, "messages: at least one message is needed (or prompt_token_ids)", "messages")
            return None
        if self.messages:
            raise APIError(400, "prompt_token_ids: give either messages or prompt_token_ids (with messages [])",
                           "prompt_token_ids")
        for name in self.TEMPLATE_OPTIONS:
            if name in self.model_fields_set:
                raise APIError(400, f"{name}: a chat template option, but prompt_token_ids are already "
                                    "templated", name)
        return token_ids(self.prompt_token_ids, vocab_size, "prompt_token_ids")

    def reused_ids(self, vocab_size: int) -> list[int] | None:
        """vLLM's decode-side token reuse: the prompt token ids a disaggregated prefill stage
        forwarded in kv_transfer_params.prompt_token_ids, generated from as they are (the
        messages are not templated); None without them or with echo (which needs the messages);
        a 400 naming the field when they are not a non-empty list of token ids."""
        kv = (self.model_extra or {}).get("kv_transfer_params")
        if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None or self.echo:
            return None
        ids = kv["prompt_token_ids"]
        name = "kv_transfer_params.prompt_token_ids"
        if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
            raise APIError(400, f"{name}={_short(ids)}: must be a non-empty list of non-negative integers", name)
        return token_ids(ids, vocab_size, name)

    def conversations(self) -> list[list[ChatMessage]]:
        return [self.messages]

    def conversation(self) -> list[dict]:
        return self.chat_turns()[0]


class BatchChatCompletionRequest(_ChatFields):
    """vLLM's /v1/chat/completions/batch: several conversations in one request, answered as one
    chat completion whose choices follow the conversations (conversation k's j-th sample is
    choice k * n + j). Not streamed."""
    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _one_prompt_per_conversation(cls, body):
        # a KV connector's pre-tokenized prompt is one conversation's: it cannot stand in for several
        kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
        many = isinstance(body, dict) and isinstance(body.get("messages"), list) and len(body["messages"]) > 1
        if many and isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
            raise APIError(400, f"kv_transfer_params.prompt_token_ids: one prompt's token ids cannot stand in "
                                f"for a batch of {len(body['messages'])} conversations",
                           "kv_transfer_params.prompt_token_ids")
        return body

    def conversations(self) -> list[list[ChatMessage]]:
        return self.messages

    def _where(self, k: int) -> str:
        return f"messages[{k}]"


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt (special tokens added unless add_special_tokens is false) or a
    conversation through the chat template (with add_generation_prompt / continue_final_message
    / chat_template_kwargs as chat takes them; special tokens only with add_special_tokens)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool = False



class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[I64]


def template_kwargs(req, trust_request_chat_template: bool = False) -> dict:
    """A chat or tokenize request's chat_template_kwargs, after vLLM's checks: not both
    add_generation_prompt and continue_final_message, and none of the names the server sets
    itself (each a 400 naming the field). A template of the request's own (`chat_template`, or
    chat_template_kwargs.chat_template) is used only on a server started with
    --trust-request-chat-template, and refused otherwise in vLLM's words."""
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "continue_final_message: not with add_generation_prompt=true (set it false)",
                       "continue_final_message")
    kw = dict(req.chat_template_kwargs or {})
    for name in ("conversation", "messages", "add_generation_prompt", "continue_final_message",
                 "tokenize", "tools", "documents"):
        if name in kw:
            raise APIError(400, f"chat_template_kwargs.{name}: set by the server (or not supported)",
                           f"chat_template_kwargs.{name}")
    own = req.chat_template if req.chat_template is not None else kw.get("chat_template")
    if own is not None:
        if not trust_request_chat_template:
            raise APIError(400, "chat_template: Chat template is passed with request, but "
                                "--trust-request-chat-template is not set. Refused request with untrusted "
                                "chat template.", "chat_template")
        if not isinstance(own, str):
            raise APIError(400, f"chat_template={_short(own)}: must be a string (a Jinja template)", "chat_template")
        kw["chat_template"] = own
    return kw


def validate_model(cls, body: dict):
    """cls.model_validate(body), with a ValidationError turned into a 400 naming the field."""
    try:
        return cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field = path_name(first.get("loc", ()))
        # vLLM's messages carry pydantic's error type (clients and vLLM's tests match on it)
        raise APIError(400, f"{field}={_short(first.get('input'))}: {first.get('msg', 'invalid')} "
                            f"[type={first.get('type', 'invalid')}]", field) from None


def _is_int(x) -> bool:
    """An integer of JSON: an int (not a bool), or a float with no fractional part."""
    return (isinstance(x, int) and not isinstance(x, bool)) or _integral(x)


def token_ids(ids: list, vocab_size: int, name: str) -> list[int]:
    """`ids` if each is in [0, vocab_size), else a 400 naming the field (vLLM's words)."""
    for t in ids:
        if t < 0:
            raise APIError(400, f"{name}: token id {t} is negative (must be greater than or equal to 0)", name)
        if t >= vocab_size:
            raise APIError(400, f"{name}: token id {t} is out of vocabulary (not in [0, {vocab_size}))", name)
    return [int(t) for t in ids]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          created_cache_tokens: int | None = None, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage. With cached_tokens (vLLM: --enable-prompt-tokens-details), its
    prompt_tokens_details: `cached_tokens`, the prompt tokens read from the prefix cache, and vLLM's
    `created_cache_tokens`, those the request wrote to it. reasoning_tokens (a reasoning parser):
    completion_tokens_details.reasoning_tokens."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens, "created_cache_tokens": created_cache_tokens}
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u
