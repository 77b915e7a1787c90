"""The server's state and the request handling its routes share: limits, parsing, admission.

A ServerContext is made once per app (engine/server/app.py create_app) and passed to the route
modules (routes_openai.py: completions and chat; routes_misc.py: health, models, metrics,
tokenize). It holds the engine and its loop thread (AsyncEngine), the metrics, the request log,
the tokenizer pool and the limits, and the steps every generation request takes before the
engine sees it: read the body within the size limit, validate it, check the model name, check
the text length without a tokenizer, apply the admission rule, make the engine's children and
refuse what the queue cannot take.
"""
from __future__ import annotations

import asyncio
import copy
import csv
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.core.admission import AdmissionError, admit
from engine.core.records import RequestRecord
from engine.core.sampling_params import MAX_LOGPROBS
from engine.prompt_embeds import PLACEHOLDER_ID, PromptEmbeds, load_prompt_embeds
from engine.server.async_engine import AsyncEngine, Child
from engine.server.metrics import ServerMetrics
from engine.server.protocol import (APIError, CompletionRequest, EmbedSlots, check_json_values,
                                    check_unsupported, loads, new_id, validate_model)

MASK64 = (1 << 64) - 1


class RequestLog:
    """Finished requests as CSV rows: the RequestRecord columns the simulator writes to
    requests.csv, plus every token's time (space-separated). sim.metrics.read_request_log
    derives the same latency columns from it. A request's id is the response's `id` (with
    `-k` appended for the k-th choice of a request with several)."""

    COLUMNS = list(RequestRecord.COLUMNS) + ["token_times_s"]

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", newline="")
        self._w = csv.writer(self._f)
        self._w.writerow(self.COLUMNS)
        self._lock = threading.Lock()

    def write(self, rec: RequestRecord) -> None:
        row = [getattr(rec, c) for c in RequestRecord.COLUMNS]
        row.append(" ".join(f"{t:.6f}" for t in (rec.token_times_s or ())))
        with self._lock:
            self._w.writerow(["" if v is None else v for v in row])
            self._f.flush()

    def close(self) -> None:
        self._f.close()


class TokenizerPool:
    """Tokenizer work on worker threads, each with its own copy (fast tokenizers must not be
    shared across threads): the event loop never waits for a tokenizer."""

    def __init__(self, tokenizer, workers: int = 2) -> None:
        self._base = tokenizer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self._lock = threading.Lock()

    def _tok(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._lock:
                tok = self._local.tok = copy.deepcopy(self._base)
        return tok

    async def run(self, fn, *args):
        """fn(tokenizer, *args) on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(self._tok(), *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _overloaded(message: str) -> APIError:
    return APIError(503, message, None, type="server_overloaded_error", code="overloaded",
                    headers={"Retry-After": "1"})


def _child_seed(seed: int | None, i: int) -> int | None:
    """vLLM: the i-th choice of a seeded request uses seed + i (kept within 64 bits)."""
    if seed is None:
        return None
    return seed + i if seed < 0 else (seed + i) & MASK64


def _field_of(e: ValueError) -> str:
    """The field an engine ValueError names first ('prompt: ...', 'request_id=...')."""
    head = str(e).split(":", 1)[0].split("=", 1)[0].strip()
    return head if head.isidentifier() else "prompt"


def _encode(tok, text: str, special: bool) -> list[int]:
    return list(tok(text, add_special_tokens=special).input_ids)


def content_format(template: str | None) -> str:
    """vLLM's --chat-template-content-format auto: "openai" for a chat template that loops over a
    message's content (it takes a list of content parts), else "string" (it renders content as
    text). Read from the template's syntax tree, not by running it."""
    if not isinstance(template, str) or not template:
        return "string"
    import jinja2
    from jinja2 import nodes
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"  # the template's own error surfaces when a request applies it
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter):  # e.g. message['content'] | selectattr(...)
            it = it.node
        if ((isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content")
                or (isinstance(it, nodes.Getattr) and it.attr == "content")):
            return "openai"
    return "string"


def _as_parts(conv: list[dict]) -> list[dict]:
    """A conversation with string contents as OpenAI content parts (one text part per message; a
    null content stays null, a list of parts stays as sent)."""
    return [{**m, "content": m["content"] if m["content"] is None or isinstance(m["content"], list)
             else [{"type": "text", "text": m["content"]}]} for m in conv]


def _apply_template(tok, conv: list[dict], add_generation_prompt: bool, continue_final: bool,
                    template_kwargs: dict | None = None, add_special_tokens: bool = False,
                    content_format: str = "string", slots: EmbedSlots | None = None):
    """The conversation templated and tokenized, (text, ids); `content_format` "openai" hands the
    template each message's content as a list of content parts (as sent, or one text part for a
    string), "string" as one string. With `slots` (the request's prompt_embeds parts, as markers
    in `conv`): (text without the markers, ids, [(first position, slot) of each marker kept by the
    template]), each marker's position holding one PLACEHOLDER_ID (split_markers)."""
    if content_format == "openai":
        conv = _as_parts(conv)
    kw = {"continue_final_message": True} if continue_final else {}
    text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt and not continue_final,
                                   tokenize=False, **kw, **(template_kwargs or {}))
    if slots is None:
        return text, _encode(tok, text, add_special_tokens)
    return split_markers(tok, text, slots, add_special_tokens)


def split_markers(tok, text: str, slots: EmbedSlots, add_special_tokens: bool):
    """A rendered prompt with prompt_embeds markers -> (text without them, ids, [(position, slot)]).
    The text between markers is tokenized piece by piece, as a tokenizer with the marker as a
    special token would (vLLM registers one); each marker is one PLACEHOLDER_ID here, which the
    route widens to its tensor's rows. A marker the template dropped drops its part (as vLLM); one
    it rendered twice is a 400."""
    found = []
    for i in range(len(slots.data)):
        tag = slots.tag(i)
        k = text.count(tag)
        if k > 1:
            raise APIError(400, f"{slots.names[i]}: the chat template rendered this prompt_embeds part {k} "
                                "times; each may appear at most once", slots.names[i])
        if k == 1:
            found.append((text.index(tag), i, tag))
    found.sort()
    head, tail = _special_wrap(tok) if add_special_tokens else ([], [])
    ids: list[int] = list(head)
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    at = 0
    for start, i, tag in found:
        piece = text[at:start]
        ids += _encode(tok, piece, False) if piece else []
        pieces.append(piece)
        spans.append((len(ids), i))
        ids.append(PLACEHOLDER_ID)
        at = start + len(tag)
    rest = text[at:]
    ids += (_encode(tok, rest, False) if rest else []) + tail
    pieces.append(rest)
    return "".join(pieces), ids, spans


def _special_wrap(tok) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (e.g. BOS), read from how it
    wraps one: the whole prompt gets them once, around its pieces."""
    plain, full = _encode(tok, "a", False), _encode(tok, "a", True)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


def with_embeds(ids: list[int], spans: list[tuple[int, int]], tensors: list) -> tuple[list[int], PromptEmbeds | None]:
    """Each one-token marker of `spans` [(position, slot)] widened to its tensor's rows: the ids
    and the PromptEmbeds of the prompt."""
    if not spans:
        return ids, None
    out: list[int] = []
    given = []
    at = 0
    for p, i in spans:
        out += ids[at:p]
        given.append((len(out), tensors[i]))
        out += [PLACEHOLDER_ID] * tensors[i].shape[0]
        at = p + 1
    out += ids[at:]
    return out, PromptEmbeds.from_spans(given)


class ServerContext:
    """One app's engine, limits and shared request handling (see the module docstring)."""

    def __init__(self, engine, model_name: str, max_waiting: int, request_timeout_s: float,
                 request_log: str | Path | None, served_model_names: list[str] | None,
                 max_body_bytes: int, tokenizer_workers: int, max_logprobs: int | None = None,
                 prompt_tokens_details: bool = True, return_tokens_as_token_ids: bool = False,
                 force_include_usage: bool = False, hidden_metrics: bool = False,
                 token_ids_only: bool = False, chat_template_content_format: str = "auto",
                 system_fingerprint: str | None = None, per_request_metrics: bool = False,
                 trust_request_chat_template: bool = False, reasoning=None,
                 enable_prompt_embeds: bool = False) -> None:
        self.engine = engine
        self.enable_prompt_embeds = enable_prompt_embeds  # vLLM's --enable-prompt-embeds
        self.reasoning = reasoning  # the reasoning parser (engine.server.reasoning), or None
        self.trust_request_chat_template = trust_request_chat_template  # a request's own template is used
        self.per_request_metrics = per_request_metrics  # vLLM's `metrics` object on single answers
        self.system_fingerprint = system_fingerprint  # of non-streamed answers (None: left out)
        self.prompt_tokens_details = prompt_tokens_details          # usage carries cached_tokens
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # the default of the request field
        # vLLM's max_logprobs: the most alternatives a request may ask for (None: vLLM's default,
        # MAX_LOGPROBS; -1: no limit)
        self.max_logprobs = MAX_LOGPROBS if max_logprobs is None else max_logprobs
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.max_body_bytes = max_body_bytes
        self.force_include_usage = force_include_usage  # vLLM's: usage in every chunk of every stream
        self.metrics = ServerMetrics(model_name, hidden=hidden_metrics)
        self.metrics.describe_cache(engine)
        self.log = RequestLog(request_log) if request_log else None
        self.aeng = AsyncEngine(engine, self.metrics, self.log, request_timeout_s)
        # the served names in the order given (the default first, as vLLM lists them), as a dict
        # for membership; the default model name joins them if it is not one of them
        self.names = dict.fromkeys([model_name, *(served_model_names or [])])
        self.tokenizer = tok = engine.tokenizer
        self.token_ids_only = token_ids_only  # vLLM's --skip-tokenizer-init: text inputs refused (check_chars)
        self.pool = TokenizerPool(tok, tokenizer_workers) if tok is not None else None
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: must be "
                             "auto, string or openai")
        # how message content reaches the chat template (vLLM's --chat-template-content-format)
        self.content_format = (content_format(getattr(tok, "chat_template", None))
                               if chat_template_content_format == "auto" else chat_template_content_format)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        # A token covers at most this many characters of text (byte-level BPE and SentencePiece
        # token strings are at least as long as the text they stand for): a longer text cannot fit
        # in max_model_len tokens, and is refused before tokenizing. x2 for normalisers that drop text.
        self.max_chars = (2 * self.max_model_len * max(len(t) for t in tok.get_vocab())) if tok is not None else 0

    def created_cache_tokens(self, num_prompt_tokens: int, num_cached_tokens: int | None) -> int:
        """vLLM's created_cache_tokens of a prefilled prompt: its tokens in full blocks that were not
        read from the prefix cache (the cache holds them now); none with prefix caching off."""
        if not self.engine.scheduler_config.enable_prefix_caching:
            return 0
        bs = self.engine.block_size
        return max(0, num_prompt_tokens // bs * bs - (num_cached_tokens or 0))

    def start(self) -> None:
        self.aeng.start()

    def stop(self) -> None:
        self.aeng.stop()
        if self.pool is not None:
            self.pool.close()
        if self.log is not None:
            self.log.close()

    async def read_optional_json(self, request: Request) -> dict:
        """The body of an endpoint that needs none: nothing, or a JSON object (else a 400)."""
        if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
            return {}
        return await self.read_json(request, allow_empty=True)

    async def read_json(self, request: Request, allow_empty: bool = False) -> dict:
        ctype = request.headers.get("content-type")
        if ctype is not None and ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(400, f"Content-Type={ctype!r}: unsupported media type; only 'application/json' "
                                "is allowed", "Content-Type")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise APIError(413, f"body: {int(size)} bytes exceeds the server's limit of "
                                f"{self.max_body_bytes}", "body")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > self.max_body_bytes:
                raise APIError(413, f"body: more than the server's limit of {self.max_body_bytes} bytes",
                               "body")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if allow_empty and not raw.strip():
            return {}
        body = loads(raw)
        if not isinstance(body, dict):
            raise APIError(400, f"body: must be a JSON object, got {type(body).__name__}", "body")
        check_json_values(body)
        return body

    async def parse(self, request: Request, cls, body: dict | None = None):
        """The request body (`body` if already read) as `cls`, or an APIError naming the field."""
        if body is None:
            body = await self.read_json(request)
        check_unsupported(body)
        req = validate_model(cls, body)
        self.check_model(req.model)
        if req.model is None:
            req.model = self.model_name
        self.check_logprobs(req)
        return req

    def check_model(self, name: str | None) -> None:
        """A 404 in vLLM's words unless `name` is None (the default model) or a served name."""
        if name is not None and name not in self.names:
            raise APIError(404, f"The model `{name}` does not exist (model={name!r}); this server serves "
                                f"{list(self.names)}", "model", code="model_not_found")

    def check_logprobs(self, req) -> None:
        """logprobs / top_logprobs / prompt_logprobs within the server's max_logprobs, as vLLM:
        -1 asks for the whole vocabulary (and becomes its size), more than max_logprobs is a 400."""
        cap = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            v = getattr(req, name, None)
            if isinstance(v, bool) or not isinstance(v, int):
                continue
            wanted = self.vocab_size if v == -1 else v
            if wanted > cap:
                raise APIError(400, f"{name}={v}: {'the whole vocabulary (' + str(wanted) + ') is ' if v == -1 else ''}"
                                    f"more than the server's max_logprobs={self.max_logprobs}", name)
            if v == -1:
                setattr(req, name, wanted)

    def check_chars(self, text: str, field: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"{field}: this model has no tokenizer; send token ids", field)
        if self.token_ids_only:
            raise APIError(400, f"{field}: the server runs with --skip-tokenizer-init (token ids in): "
                                "send the prompt as token ids", field)
        if len(text) > self.max_chars:
            raise APIError(400, f"{field}: {len(text)} characters cannot fit in max_model_len="
                                f"{self.max_model_len} tokens", field)

    def limits(self, req, n_prompt: int, field: str) -> int:
        """The request's max_tokens for a prompt of n_prompt tokens, or a 400 naming the field
        (engine.core.admission, the server's rule: prompt + max_tokens must fit)."""
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        try:
            mt = admit(n_prompt, req.requested_max_tokens, self.max_model_len, refuse_overflow=True,
                       max_tokens_field=name, prompt_field=field, default_max_tokens=req.default_max_tokens)
        except AdmissionError as e:
            raise APIError(400, str(e), e.field) from None
        problem = self.engine.scheduler.fit_problem(n_prompt, mt)  # config only: safe from this thread
        if problem is not None:
            raise APIError(400, f"{name}={mt}: {problem}", name)
        return mt

    async def decode_embeds(self, payloads: list[str], names: list[str]) -> list:
        """prompt_embeds payloads -> tensors (engine.prompt_embeds.load_prompt_embeds, off the event
        loop), or a 400 naming the field: the server must have been started with
        --enable-prompt-embeds, and each must be a (num_tokens, hidden_size) float tensor."""
        if not payloads:
            return []
        if not self.enable_prompt_embeds:
            raise APIError(400, "You must set `--enable-prompt-embeds` to input `prompt_embeds`.", names[0])
        hidden, dtype = self.engine.model.config.hidden_size, self.engine.runner.dtype

        def load(_tok):
            return [load_prompt_embeds(d, hidden, dtype, n) for d, n in zip(payloads, names)]
        try:
            return await self.pool.run(load) if self.pool is not None else load(None)
        except ValueError as e:  # its message starts with the field
            raise APIError(400, str(e), str(e).split(":", 1)[0]) from None

    def children(self, req, rid: str, prompts: list[tuple[str | None, list[int]]],
                 logprobs: int | None, embeds: list[PromptEmbeds | None] | None = None) -> list[Child]:
        """The engine requests of an HTTP request: n of each prompt; `embeds`, parallel to
        `prompts`, the vectors given for some of their positions."""
        out = []
        biases = req.token_biases(self.vocab_size)
        req.check_allowed_ids(self.vocab_size)
        embeds = embeds or [None] * len(prompts)
        cut = []
        for (text, ids), pe in zip(prompts, embeds):
            kept = req.truncated(ids, self.max_model_len)
            if pe is not None and len(kept) < len(ids):  # truncated: the vectors of the kept positions
                first = 0 if req.truncation_side == "right" else len(ids) - len(kept)
                pe = pe.window(first, first + len(kept))
            cut.append((text, kept, pe))
        prompts = [(text, ids) for text, ids, _ in cut]
        embeds = [pe for _, _, pe in cut]
        many = len(prompts) * req.n > 1
        for p, (text, ids) in enumerate(prompts):
            field = f"prompt[{p}]" if len(prompts) > 1 else "prompt"
            mt = self.limits(req, len(ids), field if isinstance(req, CompletionRequest) else "messages")
            for i in range(req.n):
                params = req.sampling_params(mt, _child_seed(req.seed, i), logprobs, biases, self.reasoning)
                cid = f"{rid}-{p * req.n + i}" if many else rid
                out.append(Child(cid, ids, params, text, req.priority, req.cache_salt, embeds[p]))
        return out

    def request_id(self, request: Request, prefix: str) -> str:
        """vLLM's: the client's X-Request-Id header, if it sent a usable one, else random; with
        the endpoint's prefix. It is the response's `id` and the request log's request_id."""
        given = request.headers.get("x-request-id", "")
        if 0 < len(given) <= 128 and given.isprintable() and "," not in given:
            return f"{prefix}-{given}"
        return new_id(prefix)

    def check_capacity(self, kids: list[Child], field: str = "n") -> None:
        if len(kids) > self.max_waiting:  # could never be queued: the request's fault, not load
            raise APIError(400, f"{field}: the request's {len(kids)} sequences exceed the server's "
                                f"max_waiting={self.max_waiting}", field)
        if not self.aeng.alive:
            raise APIError(503, f"engine is not running: {self.aeng.error!r}", None, type="server_error",
                           headers={"Retry-After": "1"})
        if self.aeng.num_waiting() + len(kids) > self.max_waiting:
            raise _overloaded(f"server overloaded: {self.aeng.num_waiting()} requests waiting "
                              f"(max_waiting={self.max_waiting}); retry later")
