"""Generation routes: POST /v1/completions and /v1/chat/completions, non-streaming and
Server-Sent Events, and how one HTTP request's choices are written (Shape)."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import struct

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.server.async_engine import Child, EngineDead, RequestFailed
from engine.prompt_embeds import PLACEHOLDER_ID, PromptEmbeds
from engine.server.context import ServerContext, _apply_template, _encode, _field_of, with_embeds
from engine.server.protocol import (APIError, BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest,
                                    EmbedSlots, now_s, template_kwargs, usage)
from engine.server.receipt import received_elapsed_s


def _response_error(e: Exception) -> APIError:
    """The error of a response that failed while it was produced (answered, or as a stream's last
    event): a bad value a 400 naming its field, a dead engine a 503 to retry, a failed request a
    500 in vLLM's words ("Internal server error", which its clients match)."""
    if isinstance(e, ValueError):
        return APIError(400, str(e), _field_of(e))
    if isinstance(e, EngineDead):
        return APIError(503, str(e), None, type="server_error", headers={"Retry-After": "1"})
    return APIError(500, f"Internal server error: {e}", None, type="server_error")


def request_metrics(out) -> dict:
    """vLLM's per-request metrics (--enable-per-request-metrics) of a finished request, in ms from
    its engine record: queue time (arrival to first scheduled), time to first token (first
    scheduled to first token), generation time (first to last token), mean ITL (over the tokens
    after the first) and tokens per second (all its tokens over first scheduled to last token);
    a value whose times are missing is left out."""
    rec, n = out.metrics, len(out.outputs[0].token_ids)
    if rec is None:
        return {}
    queued, sched, first, last = rec.arrival_s, rec.first_scheduled_s, rec.first_token_s, rec.last_token_s
    m = {}
    if sched is not None and first is not None:
        m["time_to_first_token_ms"] = max(0.0, first - sched) * 1e3
    if first is not None and last is not None:
        m["generation_time_ms"] = max(0.0, last - first) * 1e3
        if n > 1:
            m["mean_itl_ms"] = max(0.0, last - first) / (n - 1) * 1e3
    if queued is not None and sched is not None:
        m["queue_time_ms"] = max(0.0, sched - queued) * 1e3
    if sched is not None and last is not None and last > sched:
        m["tokens_per_second"] = n / (last - sched)
    return m


def add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    engine, aeng, tokenizer, pool, vocab_size = ctx.engine, ctx.aeng, ctx.tokenizer, ctx.pool, ctx.vocab_size
    parse, check_chars, children = ctx.parse, ctx.check_chars, ctx.children
    request_id, check_capacity = ctx.request_id, ctx.check_capacity

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completions(request)

    async def _completions(request: Request, body: dict | None = None):
        arrival = engine.now() - received_elapsed_s(request.scope)
        req = await parse(request, CompletionRequest, body)
        prompts = req.prompts(vocab_size)
        payloads = req.embeds_prompts()
        tensors = await ctx.decode_embeds(payloads, [f"prompt_embeds[{i}]" if isinstance(req.prompt_embeds, list)
                                                     else "prompt_embeds" for i in range(len(payloads))])
        texts = [(k, p) for k, p in enumerate(prompts) if isinstance(p, str)]
        for k, t in texts:
            check_chars(t, f"prompt[{k}]" if len(prompts) > 1 else "prompt")
        if texts:
            encoded = await pool.run(lambda tok: [_encode(tok, t, True) for _, t in texts])
            for (k, t), ids in zip(texts, encoded):
                prompts[k] = (t, ids)
        if req.echo and tokenizer is not None:
            id_prompts = [(k, p) for k, p in enumerate(prompts) if isinstance(p, list)]
            if id_prompts:
                decoded = await pool.run(lambda tok: [tok.decode(p) for _, p in id_prompts])
                for (k, p), t in zip(id_prompts, decoded):
                    prompts[k] = (t, p)
        # the prompts given as vectors first (vLLM's order), then the text and token-id ones
        prompts = [(None, [PLACEHOLDER_ID] * t.shape[0]) for t in tensors] + [
            p if isinstance(p, tuple) else (None, p) for p in prompts]
        embeds = [PromptEmbeds.from_spans([(0, t)]) for t in tensors] + [None] * (len(prompts) - len(tensors))
        rid = request_id(request, "cmpl")
        kids = children(req, rid, prompts, req.logprobs, embeds)
        first = None
        if req.echo and req.logprobs is not None and tokenizer is not None:  # the first prompt token's text
            first = await pool.run(lambda tok: [tok.decode(ids[:1]) for _, ids in prompts])
        return await respond(request, req, rid, kids, arrival, chat=False,
                             echo=[t or "" for t, _ in prompts] if req.echo else None, first_tokens=first)


    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _chat(request)

    async def _chat(request: Request, body: dict | None = None, batch: bool = False):
        arrival = engine.now() - received_elapsed_s(request.scope)
        req = await parse(request, BatchChatCompletionRequest if batch else ChatCompletionRequest, body)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model={req.model!r} has no chat template", "model")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", "top_logprobs")
        if batch and req.stream:
            raise APIError(400, "stream: a batch of conversations is not streamed", "stream")
        ids_in = None if batch else req.token_in(ctx.vocab_size)
        if ids_in is None and not batch:  # a prefill stage's ids, forwarded for the decode stage
            ids_in = req.reused_ids(ctx.vocab_size)
        embeds = None
        if ids_in is not None:  # token-in: the conversation arrives templated
            templated = [(None, ids_in)]
        else:
            slots = EmbedSlots()  # prompt_embeds parts become markers in the text the template renders
            for k, conv in enumerate(req.chat_turns(slots=slots)):
                check_chars("".join(m["content"] for m in conv), f"messages[{k}]" if batch else "messages")
            tensors = await ctx.decode_embeds(slots.data, slots.names)
            # the template's view: content parts as sent (their other fields too) under "openai"
            convs = req.chat_turns(parts=ctx.content_format == "openai", slots=slots)
            kw = template_kwargs(req, ctx.trust_request_chat_template)
            try:
                rendered = await pool.run(lambda tok: [_apply_template(tok, conv, req.add_generation_prompt,
                                                                        req.continue_final_message, kw,
                                                                        req.add_special_tokens,
                                                                        ctx.content_format, slots if tensors else None)
                                                       for conv in convs])
            except APIError:
                raise
            except Exception as e:  # the template refused a conversation (e.g. role order)
                raise APIError(400, f"messages: the chat template refused them: {e}", "messages") from None
            if tensors:  # each marker's one placeholder widened to its tensor's rows
                templated, embeds = [], []
                for text, ids, spans in rendered:
                    ids, pe = with_embeds(ids, spans, tensors)
                    templated.append((text, ids))
                    embeds.append(pe)
            else:
                templated = rendered
        rid = request_id(request, "chatcmpl")
        kids = children(req, rid, templated, (req.top_logprobs or 0) if req.logprobs else None, embeds)
        return await respond(request, req, rid, kids, arrival, chat=True, echo=req.echo_texts())

    @app.post("/v1/chat/completions/batch")
    async def chat_batch(request: Request):
        """vLLM's batch of conversations: `messages` is a list of conversations; one chat
        completion answers them all, choice k * n + j for conversation k's j-th sample."""
        return await _chat(request, batch=True)

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's entry point, as vLLM serves it: a body with `messages` is a chat completion,
        anything else a completion (whose checks then name what is wrong)."""
        body = await ctx.read_json(request)
        if "messages" in body:
            return await _chat(request, body)
        return await _completions(request, body)

    async def respond(request: Request, req, rid: str, kids: list[Child], arrival: float, chat: bool,
                      echo: list[str] | None = None, first_tokens: list[str] | None = None):
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
        tokens_as_ids = bool(ctx.return_tokens_as_token_ids if req.return_tokens_as_token_ids is None
                             else req.return_tokens_as_token_ids)
        packed = bool(getattr(req, "packed_top_logprobs", False))
        if packed and not tokens_as_ids:
            raise APIError(400, "packed_top_logprobs=true: needs return_tokens_as_token_ids=true (in the request, "
                                "or the server's --return-tokens-as-token-ids)", "packed_top_logprobs")
        check_capacity(kids, "n" if req.n > 1 else "prompt" if not chat else "messages")
        try:
            group = aeng.submit(kids, arrival, stream=bool(req.stream))  # same event-loop turn as check_capacity(): counted at once
        except EngineDead as e:
            raise APIError(503, str(e), None, type="server_error", headers={"Retry-After": "1"}) from None
        gen = aeng.outputs(group)
        n_prompts = len(kids) // req.n
        ctx.metrics.on_submit(req.n, [kids[p * req.n].params.max_tokens for p in range(n_prompts)])
        prompt_lens = [len(kids[p * req.n].prompt_token_ids) for p in range(n_prompts)]
        shape = Shape(rid, now_s(), req.model, chat, req.n, prompt_lens, echo,
                      prompt_logprobs=req.prompt_logprobs,
                      echo_logprobs=req.logprobs if not chat and echo is not None else None,
                      echo_only=bool(getattr(req, "echo_only", False)), first_tokens=first_tokens,
                      prompt_ids=[_given_ids(kids[p * req.n]) for p in range(n_prompts)]
                      if req.return_token_ids else None,
                      tokens_as_ids=tokens_as_ids, packed_k=req.logprobs if packed else None,
                      cached_details=ctx.prompt_tokens_details,
                      created_cache_tokens=ctx.created_cache_tokens,
                      reasoning=ctx.reasoning if chat else None,
                      include_reasoning=bool(getattr(req, "include_reasoning", True)), tokenizer=tokenizer,
                      first_ids=[kids[p * req.n].prompt_token_ids[0] if kids[p * req.n].prompt_token_ids else None
                                 for p in range(n_prompts)])
        if req.stream:
            cont = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            include = req.include_usage
            if ctx.force_include_usage:  # vLLM's --enable-force-include-usage: usage in every chunk
                include = cont = True
            return StreamingResponse(sse(gen, shape, include, cont),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Request-Id": rid})
        body = await complete(request, gen, shape, len(kids))
        return body if isinstance(body, Response) else JSONResponse(body, headers={"X-Request-Id": rid})

    async def complete(request: Request, gen, shape: "Shape", n: int):
        finals: dict[int, object] = {}

        async def consume():
            async for i, out in gen:
                if out.finished:
                    finals[i] = out

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()  # the generator's cleanup aborts the requests in the engine
                    await asyncio.gather(task, return_exceptions=True)
                    return Response(status_code=499)
            exc = task.exception()
            if exc is not None:
                raise exc
        except (ValueError, EngineDead, RequestFailed) as e:
            raise _response_error(e) from None
        outs = [finals[i] for i in range(n)]
        if any(o.outputs[0].finish_reason == "error" for o in outs):
            raise _response_error(RequestFailed("the engine failed while producing this response"))
        choices = [shape.choice(i, o.outputs[0], o.prompt_logprobs) for i, o in enumerate(outs)]
        # vLLM's response fields: OpenAI's service_tier (null here) and system_fingerprint (the
        # server's, left out with --fingerprint-mode none), and a chat's prompt_token_ids
        # (return_token_ids) and prompt_logprobs on the response, not on its choices (null when
        # not asked)
        body = {"id": shape.rid, "object": shape.obj(False), "created": shape.created, "model": shape.model,
                "choices": choices, "service_tier": None, "system_fingerprint": ctx.system_fingerprint,
                "usage": shape.usage(outs)}
        if ctx.system_fingerprint is None:
            del body["system_fingerprint"]
        if ctx.per_request_metrics and n == 1:  # one generation's timings (vLLM: none for n > 1)
            body["metrics"] = request_metrics(outs[0])
        if shape.chat:
            one = len(shape.prompt_lens) == 1  # several conversations (batch): on each choice instead
            body["prompt_token_ids"] = shape.prompt_ids[0] if shape.prompt_ids is not None and one else None
            body["prompt_logprobs"] = (shape.vllm_prompt_logprobs(outs[0].prompt_logprobs)
                                       if shape.prompt_logprobs is not None and one else None)
        return body

    async def sse(gen, shape: "Shape", include_usage: bool, continuous: bool):
        latest: dict[int, object] = {}
        sent = {}          # choice index -> text already sent
        sent_lp = {}       # choice index -> logprob entries already sent
        sent_off = {}      # choice index -> length of the texts of the logprob tokens already sent
        first_sent: set[int] = set()  # choices whose first token has been sent
        prompt_sent: set[int] = set()  # choices whose prompt (echo, prompt logprobs) has been sent
        sent_ids: dict[int, int] = {}  # choice index -> token ids already sent (return_token_ids)
        sent_parts: dict[int, tuple[str, str]] = {}  # with a reasoning parser: reasoning, content sent

        first_event = True

        def event(choices: list[dict], usage_body=None, metrics=None) -> str:
            nonlocal first_event
            if not shape.chat:  # vLLM's completion chunks carry its extension fields, null when unused
                for ch in choices:
                    for name in ("stop_reason", "prompt_token_ids", "token_ids"):
                        ch.setdefault(name, None)
            body = {"id": shape.rid, "object": shape.obj(True), "created": shape.created, "model": shape.model,
                    "choices": choices}
            if first_event and shape.chat and shape.prompt_ids is not None:
                body["prompt_token_ids"] = shape.prompt_ids[0]  # vLLM: on a chat stream's first chunk
            first_event = False
            if usage_body is not None:
                body["usage"] = usage_body
            if metrics is not None:
                body["metrics"] = metrics
            return f"data: {json.dumps(body)}\n\n"

        try:
            # vLLM: usage in a chunk only with include_usage; with continuous_usage_stats too, in
            # every chunk (the counts so far)
            continuous = continuous and include_usage
            first_usage = usage(sum(shape.prompt_lens), 0) if continuous else None
            for i in range(shape.num_choices):
                if shape.chat:
                    content = shape.echo[i // shape.n] if shape.echo is not None else ""
                    yield event([{"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                                  "finish_reason": None}], first_usage)
                elif shape.echo is not None and shape.echo_logprobs is None:
                    yield event([{"index": i, "text": shape.echo[i // shape.n], "logprobs": None,
                                  "finish_reason": None}], first_usage)
            async for i, out in gen:
                latest[i] = out
                c = out.outputs[0]
                if c.finish_reason == "error":
                    raise RequestFailed("the engine failed while producing this response")
                if i not in prompt_sent and (shape.echo_logprobs is not None or shape.prompt_logprobs is not None):
                    # the prompt's logprobs come with a choice's first output, in a chunk of their own
                    prompt_sent.add(i)
                    yield event([shape.prompt_chunk(i, out.prompt_logprobs)], first_usage)
                if shape.echo_only:
                    c = shape.nothing_generated(c)
                thought = ""
                if shape.reasoning is not None:  # the new text split into reasoning and content
                    r, a, _ = shape.reasoning.split(c.text, final=c.finish_reason is not None)
                    pr, pa = sent_parts.get(i, ("", ""))
                    r, a = r or "", a or ""
                    thought = r[len(pr):] if r.startswith(pr) else ""
                    delta = a[len(pa):] if a.startswith(pa) else ""
                    sent_parts[i] = (r if r.startswith(pr) else pr, a if a.startswith(pa) else pa)
                    if not shape.include_reasoning:
                        thought = ""
                else:
                    prev = sent.get(i, "")
                    delta = c.text[len(prev):] if c.text.startswith(prev) else ""
                    if delta:
                        sent[i] = c.text
                lp = None
                if c.logprobs is not None and len(c.logprobs) > sent_lp.get(i, 0):
                    # text_offset counts the tokens' texts (as without a stream), not the text sent
                    # so far, which lags them while a stop string may be forming
                    lp = shape.logprobs(c.logprobs[sent_lp.get(i, 0):], sent_off.get(i, 0) + shape.echo_len(i))
                    sent_lp[i] = len(c.logprobs)
                    if not shape.chat:
                        sent_off[i] = sent_off.get(i, 0) + sum(len(t) for t in lp["tokens"])
                new_ids = None
                if shape.prompt_ids is not None:
                    new_ids = list(c.token_ids[sent_ids.get(i, 0):])
                    sent_ids[i] = len(c.token_ids)
                # with return_token_ids a chunk carries every new token id, also those whose text is
                # held back (a character not complete yet, a stop string forming), as vLLM's
                if delta or thought or c.finish_reason is not None or lp is not None or new_ids:
                    chunk = event([shape.delta(i, delta, c, lp, new_ids, first=i not in first_sent,
                                               reasoning=thought)],
                                  shape.usage(list(latest.values())) if continuous else None)
                    if i not in first_sent:  # the log's first token time: handed to the connection
                        first_sent.add(i)
                        aeng.first_token_sent(out.request_id)
                    yield chunk
            if include_usage:  # the last chunk; vLLM's per-request metrics ride on it
                metrics = (request_metrics(latest[0]) if ctx.per_request_metrics and shape.num_choices == 1
                           else None)
                yield event([], shape.usage([latest[i] for i in sorted(latest)]), metrics)
            yield "data: [DONE]\n\n"
        except (ValueError, EngineDead, RequestFailed) as e:
            yield f"data: {json.dumps(_response_error(e).body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()  # on disconnect: aborts the requests in the engine


def _given_ids(kid) -> list[int] | None:
    """A prompt's token ids as return_token_ids reports them: none for a prompt given wholly as
    vectors (vLLM's null), else its ids (an embedded position's placeholder included)."""
    pe = kid.prompt_embeds
    return None if pe is not None and len(pe) == len(kid.prompt_token_ids) else kid.prompt_token_ids


class Shape:
    """How one HTTP request's choices are written: ids, objects, choices, logprobs, usage."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, n: int, prompt_lens: list[int],
                 echo: list[str] | None, prompt_logprobs: int | None = None, echo_logprobs: int | None = None,
                 echo_only: bool = False, first_tokens: list[str] | None = None,
                 prompt_ids: list[list[int]] | None = None, tokens_as_ids: bool = False,
                 cached_details: bool = True, first_ids: list[int] | None = None,
                 packed_k: int | None = None, created_cache_tokens=None, reasoning=None,
                 include_reasoning: bool = True, tokenizer=None) -> None:
        self.rid, self.created, self.model, self.chat, self.n = rid, created, model, chat, n
        self.prompt_lens, self.echo = prompt_lens, echo
        self.num_choices = n * len(prompt_lens)
        # vLLM's choice.prompt_logprobs: alternatives per prompt token (None: not asked); completions'
        # echo + logprobs: the prompt's tokens lead the logprobs, with this many alternatives
        # (the engine computed max of the two: each output is cut to its own)
        self.prompt_logprobs = prompt_logprobs
        self.echo_logprobs = echo_logprobs
        self._prompt_end: dict[int, int] = {}  # choice -> end of its prompt tokens' offsets
        self.echo_only = echo_only              # echo with max_tokens 0: the generated token is dropped
        self.first_tokens = first_tokens        # each prompt's first token's text (echo + logprobs)
        self.first_ids = first_ids              # and its id (return_tokens_as_token_ids)
        self.prompt_ids = prompt_ids            # return_token_ids: each prompt's token ids
        self.tokens_as_ids = tokens_as_ids      # return_tokens_as_token_ids
        self.cached_details = cached_details    # usage.prompt_tokens_details.cached_tokens
        self.created_cache_tokens = created_cache_tokens  # (prompt tokens, cache hits) -> tokens written
        self.reasoning = reasoning              # a chat's reasoning parser (engine.server.reasoning)
        self.include_reasoning = include_reasoning  # message.reasoning written (else left null)
        self.tokenizer = tokenizer              # counts reasoning tokens when markers are not one token
        self.packed_k = packed_k                # packed_top_logprobs: this many alternatives a token

    @staticmethod
    def nothing_generated(c):
        """An echo-only choice's output: no text, tokens or logprobs of its own."""
        return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                   finish_reason=c.finish_reason and "length", stop_reason=None)

    def vllm_prompt_logprobs(self, entries) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank,
        decoded_token}} with the prompt token and its alternatives."""
        out = []
        k = self.prompt_logprobs or 0
        for e in entries or []:
            if e is None:
                out.append(None)
                continue
            d = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
            for rank, (t, s, v) in enumerate(e.top[:k], start=1):
                d.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": s})
            out.append(d)
        return out

    def echo_prompt_logprobs(self, i: int, entries) -> dict:
        """The legacy completions logprobs of choice i's echoed prompt: its tokens, their logprobs
        (None for the first, which nothing precedes), top alternatives and offsets into the text."""
        tokens, lps, tops, offsets, off = [], [], [], [], 0
        for e in entries or []:
            offsets.append(off)
            if e is None:
                t = self.first_tokens[i // self.n] if self.first_tokens else ""
                first_id = self.first_ids[i // self.n] if self.first_ids else None
                tokens.append(self._tok(first_id, t) if first_id is not None else t)
                lps.append(None)
                tops.append(None)
                off += len(t)
                continue
            tokens.append(self._tok(e.token_id, e.token))
            lps.append(e.logprob)
            tops.append({self._tok(e.token_id, e.token): e.logprob,
                         **{self._tok(t, s): v for t, s, v in e.top[:self.echo_logprobs or 0]}})
            off += len(e.token)
        self._prompt_end[i] = off
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_chunk(self, i: int, entries) -> dict:
        """A stream's chunk with choice i's prompt: its echo and, as asked, its logprobs."""
        if self.chat:
            ch = {"index": i, "delta": {}, "logprobs": None, "finish_reason": None}
        else:
            echoes = self.echo is not None and self.echo_logprobs is not None
            ch = {"index": i, "text": self.echo[i // self.n] if echoes else "",
                  "logprobs": self.echo_prompt_logprobs(i, entries) if echoes else None,
                  "finish_reason": None}
        if self.prompt_logprobs is not None:
            ch["prompt_logprobs"] = self.vllm_prompt_logprobs(entries)
        return ch

    def obj(self, stream: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def echo_len(self, i: int) -> int:
        """Where choice i's generated text starts in its logprobs' text_offset: after the echoed
        prompt (with echo + logprobs, after the prompt tokens' own texts, as their offsets run)."""
        if i in self._prompt_end:
            return self._prompt_end[i]
        return len(self.echo[i // self.n]) if self.echo is not None else 0

    def _tok(self, token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else text

    def logprobs(self, entries, offset: int) -> dict:
        if self.packed_k is not None:
            return self.packed_logprobs(entries, offset)
        if self.tokens_as_ids:
            entries = [dataclasses.replace(e, token=self._tok(e.token_id, e.token),
                                           top=[(t, self._tok(t, s), v) for t, s, v in e.top]) for e in entries]
        if self.chat:
            return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                                 "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                                  for _, s, v in e.top]} for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        # vLLM: each entry's top_logprobs holds the sampled token too (logprobs=0: only it)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{e.token: e.logprob, **{s: v for _, s, v in e.top}} for e in entries],
                "text_offset": offsets}

    def packed_logprobs(self, entries, offset: int) -> dict:
        """vLLM's packed_top_logprobs: each token's alternatives (the engine's top k, in its order)
        as two base64 arrays of raw little-endian bytes, int32 ids and float32 logprobs, row-major
        [tokens, k], -inf kept; top_logprobs empty; the sampled tokens written token_id:ID, their
        logprobs clamped at -9999 (JSON has no -inf), their text_offset counted over those names."""
        k = self.packed_k
        ids = [t for e in entries for t, _, _ in e.top[:k]]
        values = [v for e in entries for _, _, v in e.top[:k]]
        if len(ids) != k * len(entries):
            raise RequestFailed(f"packed_top_logprobs: the engine reported fewer than {k} alternatives")
        tokens = [f"token_id:{e.token_id}" for e in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
        packed = {"shape": [len(entries), k], "token_ids_dtype": "<i4", "logprobs_dtype": "<f4",
                  "token_ids_b64": base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode("ascii"),
                  "logprobs_b64": base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")}
        return {"tokens": tokens, "token_logprobs": [max(e.logprob, -9999.0) for e in entries],
                "top_logprobs": [], "text_offset": offsets, "packed_top_logprobs": packed}

    def choice(self, i: int, c, prompt_lps=None) -> dict:
        if self.echo_only:
            c = self.nothing_generated(c)
        lp = None
        if c.logprobs is not None and self.echo_logprobs is not None:
            # the generated tokens' offsets go on from the end of the prompt's tokens' text
            head = self.echo_prompt_logprobs(i, prompt_lps)
            lp = self.logprobs(c.logprobs, self.echo_len(i))
            lp = {k: head[k] + lp[k] for k in lp}
        elif c.logprobs is not None:
            lp = self.logprobs(c.logprobs, self.echo_len(i))
        # vLLM's extension fields are present, null when unused (its clients and tests read them
        # as attributes); chat leaves out prompt_logprobs unless asked, as vLLM's chat does
        choice = {"index": i, "finish_reason": c.finish_reason, "logprobs": lp, "stop_reason": c.stop_reason}
        if not self.chat or (self.prompt_logprobs is not None and len(self.prompt_lens) > 1):
            # a chat's are on the response (vLLM); a batch of conversations has its own per choice
            choice["prompt_logprobs"] = (self.vllm_prompt_logprobs(prompt_lps) if self.prompt_logprobs is not None
                                         else None)
        head = self.echo[i // self.n] if self.echo is not None else ""
        if self.chat:
            # (no annotations / audio / function_call: OpenAI's schema has no null for the first
            # and the last, and a client's SDK fills in what is absent)
            content, reasoning = head + c.text, None
            if self.reasoning is not None:  # the thinking to message.reasoning, the rest to content
                reasoning, answer, _ = self.reasoning.split(c.text)
                content = head + answer if answer is not None else (head or None)
                reasoning = (reasoning or None) if self.include_reasoning else None
            choice["message"] = {"role": "assistant", "content": content, "refusal": None, "tool_calls": [],
                                 "reasoning": reasoning}
            if self.prompt_ids is not None and len(self.prompt_lens) > 1:  # a batch: each its conversation's
                choice["prompt_token_ids"] = self.prompt_ids[i // self.n]
        else:
            choice["text"] = head + c.text
            choice["prompt_token_ids"] = self.prompt_ids[i // self.n] if self.prompt_ids is not None else None
        choice["token_ids"] = list(c.token_ids) if self.prompt_ids is not None else None
        return choice

    def delta(self, i: int, text: str, c, lp, token_ids: list[int] | None = None, first: bool = False,
              reasoning: str = "") -> dict:
        if self.chat:
            d = {"content": text}  # "" on a last chunk with no text left, as vLLM
            if reasoning:  # a reasoning parser's share of the new text (content only when it has some)
                d = {"reasoning": reasoning, **({"content": text} if text else {})}
            out = {"index": i, "delta": d, "logprobs": lp, "finish_reason": c.finish_reason}
        else:
            out = {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
        if token_ids is not None:
            out["token_ids"] = token_ids
            if first and not self.chat:
                out["prompt_token_ids"] = self.prompt_ids[i // self.n]
        if c.finish_reason is not None:  # vLLM's last chunk of a choice says what stopped it
            out["stop_reason"] = c.stop_reason
        return out

    def usage(self, outs) -> dict:
        """Prompt tokens count each prompt once (not once per choice); cached tokens are the
        prefix-cache hits of each prompt's first choice, and created ones (vLLM's
        created_cache_tokens, ServerContext.created_cache_tokens) those it wrote to the cache."""
        completion = 0 if self.echo_only else sum(len(o.outputs[0].token_ids) for o in outs)
        firsts = {}
        for o in outs:
            firsts.setdefault(self._prompt_of(o.request_id), o)
        reasoning = None
        if self.reasoning is not None:  # every choice's reasoning tokens
            reasoning = 0 if self.echo_only else sum(
                self.reasoning.count_tokens(list(o.outputs[0].token_ids), self.reasoning.split(o.outputs[0].text)[0],
                                            self.tokenizer) for o in outs)
        if not self.cached_details:
            return usage(sum(self.prompt_lens), completion, reasoning_tokens=reasoning)
        cached = sum(o.num_cached_tokens or 0 for o in firsts.values())
        created = sum(self.created_cache_tokens(self.prompt_lens[p], o.num_cached_tokens)
                      for p, o in firsts.items()) if self.created_cache_tokens else 0
        return usage(sum(self.prompt_lens), completion, cached, created, reasoning)

    def _prompt_of(self, request_id: str) -> int:
        if self.num_choices == 1:
            return 0
        return int(request_id.rsplit("-", 1)[1]) // self.n
