"""vLLM's Decisions API: POST /v1/decisions answers questions about a text from the model's
next-token probabilities, without generating a reply.

Each question is one engine request (one generated token), as vLLM's next-token reading runs
it: the input text, then the question with a letter per option ("A: ...", "B: ...") and "Answer
with the letter of one option only.", as the user turn of the chat template with thinking off.
The request reports the log-probabilities of the option letters as the reply's first token
(SamplingParams.logprob_token_ids); their softmax is the answer:
- predicate: options false / true; `probability` is true's;
- choice: `probabilities` per value, `choice` the most likely;
- score: levels 0..n-1; `score` is the expected level.
`confidence` is the top option's share times the letters' total probability over the vocabulary.
Text input only (an image part is a 400, in vLLM's words).
"""
from __future__ import annotations

import json
import math
import string
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from engine.core.sampling_params import SamplingParams
from engine.server.async_engine import Child
from engine.server.context import ServerContext, _apply_template
from engine.server.protocol import APIError, validate_model
from engine.server.receipt import received_elapsed_s

LABELS = tuple(string.ascii_uppercase)
ShortText = Annotated[StrictStr, Field(max_length=1 << 20)]
InputText = Annotated[StrictStr, Field(max_length=10 << 20)]


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecisionInputText(_Forbid):
    type: Literal["input_text"]
    text: InputText


class DecisionInputMessage(_Forbid):
    role: Literal["user"]
    content: InputText | Annotated[list[DecisionInputText], Field(max_length=16384)]
    type: Literal["message"] = "message"

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list) and any(
                isinstance(p, dict) and p.get("type") == "input_image" for p in data["content"]):
            raise ValueError("Decisions supports text input only; images are not supported")
        return data

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class _Question(_Forbid):
    instructions: ShortText
    name: ShortText | None = None

    @model_validator(mode="after")
    def _named(self):
        if "name" in self.model_fields_set and self.name is None:
            raise ValueError("name must be a string when provided")
        return self


class PredicateQuestion(_Question):
    type: Literal["predicate"]


class ChoiceOption(_Forbid):
    value: StrictStr | StrictBool
    description: ShortText = ""


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    choices: list[ChoiceOption] = Field(min_length=2, max_length=len(LABELS))

    @model_validator(mode="after")
    def _distinct(self):
        values = [(type(c.value), c.value) for c in self.choices]
        if len(set(values)) != len(values):
            raise ValueError("choice values must be distinct")
        return self


class ScoreLevel(_Forbid):
    label: ShortText
    description: ShortText = ""


class ScoreQuestion(_Question):
    type: Literal["score"]
    levels: list[ScoreLevel] = Field(min_length=2, max_length=10)


class DecisionRequest(_Forbid):
    model: ShortText | None = None
    input: InputText | Annotated[list[DecisionInputMessage], Field(max_length=131072)]
    questions: list[Annotated[PredicateQuestion | ChoiceQuestion | ScoreQuestion,
                              Field(discriminator="type")]] = Field(min_length=1, max_length=64)
    safety_identifier: Annotated[StrictStr, Field(max_length=128)] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _no_images(cls, data: Any) -> Any:
        """An image part anywhere in the input: a 400 in vLLM's words, before the union of input
        forms names a branch it did not match."""
        msgs = data.get("input") if isinstance(data, dict) else None
        for k, m in enumerate(msgs if isinstance(msgs, list) else []):
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in parts):
                raise APIError(400, f"input[{k}].content: Decisions supports text input only; images are not "
                                    "supported", f"input[{k}].content")
        return data

    def input_text(self) -> str:
        return self.input if isinstance(self.input, str) else "\n\n".join(m.text() for m in self.input)


class PredicateAnswer(_Forbid):
    type: Literal["predicate"]
    name: str | None
    probability: float = Field(description="the probability that the predicate holds")


class ChoiceProbability(_Forbid):
    value: StrictStr | StrictBool
    probability: float


class ChoiceAnswer(_Forbid):
    type: Literal["choice"]
    name: str | None
    choice: StrictStr | StrictBool = Field(description="the most likely value")
    probabilities: list[ChoiceProbability]
    confidence: float = Field(description="the choice's share x the option letters' total probability")


class ScoreProbability(_Forbid):
    value: int
    label: str
    probability: float


class ScoreAnswer(_Forbid):
    type: Literal["score"]
    name: str | None
    score: float = Field(description="the expected level (levels numbered from 0)")
    probabilities: list[ScoreProbability]
    confidence: float


class DecisionUsage(_Forbid):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(description="cached_tokens (read from the prefix cache) and "
                                                             "cache_write_tokens (written to it)")
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class DecisionResponse(_Forbid):
    model: str
    answers: list[Annotated[PredicateAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]]
    usage: DecisionUsage


def options(q) -> list[tuple[str, str]]:
    """(name, description) of a question's options, in label order."""
    if isinstance(q, PredicateQuestion):
        return [("false", ""), ("true", "")]
    if isinstance(q, ChoiceQuestion):
        return [(json.dumps(c.value, ensure_ascii=False), c.description) for c in q.choices]
    return [(level.label, level.description) for level in q.levels]


def question_text(q) -> str:
    """The question as the model reads it after the input: heading, one labelled line per option,
    the reply instruction."""
    lines = [f"{label}: {name} - {desc}" if desc else f"{label}: {name}"
             for label, (name, desc) in zip(LABELS, options(q))]
    lines.append("Answer with the letter of one option only.")
    body = "\n".join(lines)
    return f"Question: {q.instructions}\n{body}" if q.instructions else body


def answer(q, logprobs: list[float]) -> dict:
    """The answer from the option letters' log-probabilities (their softmax)."""
    top_lp = max(logprobs)
    weights = [math.exp(lp - top_lp) for lp in logprobs]
    probs = [w / sum(weights) for w in weights]
    mass = sum(math.exp(lp) for lp in logprobs)
    if isinstance(q, PredicateQuestion):
        return {"type": "predicate", "name": q.name, "probability": probs[1]}
    top = max(range(len(probs)), key=probs.__getitem__)
    confidence = probs[top] * mass
    if isinstance(q, ChoiceQuestion):
        return {"type": "choice", "name": q.name, "choice": q.choices[top].value,
                "probabilities": [{"value": c.value, "probability": p} for c, p in zip(q.choices, probs)],
                "confidence": confidence}
    return {"type": "score", "name": q.name, "score": sum(i * p for i, p in enumerate(probs)),
            "probabilities": [{"value": i, "label": lv.label, "probability": p}
                              for i, (lv, p) in enumerate(zip(q.levels, probs))],
            "confidence": confidence}


def label_ids(tok) -> list[int] | None:
    """The token each option letter is as the reply's first token after the chat template's
    generation prompt (its text after the last special token, then the letter), or None when a
    letter is not one distinct token there (the model cannot answer decisions)."""
    probe = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(probe, add_special_tokens=False)
    added = set(tok.get_added_vocab().values())
    start = max((i + 1 for i, t in enumerate(ids) if t in added), default=0)
    tail, text = ids[start:], tok.decode(ids[start:])
    out: list[int] = []
    for letter in LABELS:
        ext = tok.encode(text + letter, add_special_tokens=False)
        if ext[:-1] != tail or ext[-1] in out:
            return None
        out.append(ext[-1])
    return out


def add_decision_routes(app: FastAPI, ctx: ServerContext) -> None:
    engine, aeng, tokenizer, pool = ctx.engine, ctx.aeng, ctx.tokenizer, ctx.pool
    letters: dict[str, list[int] | None] = {}

    @app.post("/v1/decisions")
    async def decisions(request: Request):
        arrival = engine.now() - received_elapsed_s(request.scope)
        body = await ctx.read_json(request)
        req = validate_model(DecisionRequest, body)
        ctx.check_model(req.model)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(501, "The model does not support the Decisions API (it has no chat template)", None,
                           type="not_implemented")
        if "ids" not in letters:
            letters["ids"] = await pool.run(label_ids)
        ids = letters["ids"]
        if ids is None:
            raise APIError(501, "The model does not support the Decisions API (an option letter is not one "
                                "token after its chat prompt)", None, type="not_implemented")
        state = req.input_text()
        ctx.check_chars(state, "input")
        convs = [[{"role": "user", "content": f"{state}\n\n{question_text(q)}"}] for q in req.questions]
        prompts = await pool.run(lambda tok: [_apply_template(tok, c, True, False, {"enable_thinking": False})[1]
                                              for c in convs])
        rid = ctx.request_id(request, "decision")
        kids = []
        for k, (q, p) in enumerate(zip(req.questions, prompts)):
            if len(p) + 1 > ctx.max_model_len:
                raise APIError(400, f"questions[{k}]: the input and question take {len(p)} tokens, more than "
                                    f"max_model_len={ctx.max_model_len} allows", f"questions[{k}]")
            n = len(options(q))
            params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=n, logprob_token_ids=ids[:n],
                                    max_logprobs=-1)
            kids.append(Child(f"{rid}-{k}", p, params, None, 0, req.cache_salt))
        ctx.check_capacity(kids, "questions")
        group = aeng.submit(kids, arrival)
        finals = {}
        async for i, out in aeng.outputs(group):
            if out.finished:
                finals[i] = out
        answers, cached, created = [], 0, 0
        for k, q in enumerate(req.questions):
            out = finals[k]
            entry = out.outputs[0].logprobs[0]
            by_id = {t: v for t, _, v in entry.top}
            answers.append(answer(q, [by_id[t] for t in ids[:len(options(q))]]))
            cached += out.num_cached_tokens or 0
            created += ctx.created_cache_tokens(len(out.prompt_token_ids), out.num_cached_tokens)
        input_tokens = sum(len(finals[k].prompt_token_ids) for k in finals)
        output_tokens = sum(len(finals[k].outputs[0].token_ids) for k in finals)
        return JSONResponse({"model": req.model or ctx.model_name, "answers": answers,
                             "usage": {"input_tokens": input_tokens,
                                       "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": created},
                                       "output_tokens": output_tokens,
                                       "output_tokens_details": {"reasoning_tokens": 0},
                                       "total_tokens": input_tokens + output_tokens}})
