"""Random and malformed request bodies for the server fuzz (tests/test_server_robust.py and
bench/server_fuzz.py): mostly valid bodies with a few fields replaced by random JSON values
(wrong types, huge integers, lone surrogates, nested junk), and some bodies that are not JSON."""
from __future__ import annotations

import json
import random

MODEL = "default"

_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stream", "stream_options", "logprobs", "top_logprobs", "echo", "presence_penalty", "min_tokens", "min_characters",
           "stop_token_ids", "ignore_eos", "priority", "tools", "logit_bias", "best_of", "whatever"]


def fuzz_value(rng: random.Random, depth: int = 0):
    k = rng.randrange(14)
    if k == 0:
        return None
    if k == 1:
        return rng.choice([True, False])
    if k == 2:
        return rng.choice([0, 1, -1, 2, 3, 7, 2 ** 31, 2 ** 63, 2 ** 64, 2 ** 70, -2 ** 64])
    if k == 3:
        return rng.choice([0.0, 0.5, 1.0, -0.5, 1e308, 2.5, 1e-9])
    if k == 4:
        return rng.choice(["", "hi", "default", "x\ud800y", "\udfff", "é" * 3, "\x00", "5", "yes", "Infinity"])
    if k == 5 and depth < 3:
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if k == 6 and depth < 3:
        return {rng.choice(["type", "text", "role", "content", "x"]): fuzz_value(rng, depth + 1)
                for _ in range(rng.randrange(3))}
    if k == 7:
        return [rng.randrange(-5, 60000) for _ in range(rng.randrange(1, 5))]
    if k == 8:
        return [{"role": rng.choice(["user", "system", "assistant", "tool", "bot"]),
                 "content": fuzz_value(rng, depth + 1)}]
    return rng.choice([1, 2, "hi", [1, 2], 0.7])

def fuzz_body(rng: random.Random) -> bytes:
    """A mostly valid body with a few fields replaced by random JSON, or broken bytes."""
    if rng.random() < 0.08:
        return rng.choice([b"", b"{", b"null", b"[]", b'{"model": "default", "prompt": "hi"',
                           bytes(rng.randrange(256) for _ in range(20)), b'{"prompt": NaN}'])
    body = {"model": MODEL, "prompt": "Fuzz", "max_tokens": rng.randrange(1, 4)}
    if rng.random() < 0.3:
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": "Fuzz"}]
    for _ in range(rng.randrange(1, 4)):
        body[rng.choice(_FIELDS)] = fuzz_value(rng)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4  # keep the valid ones short
    if body.get("max_tokens") is None:  # "as many as fit" would run for minutes on a CPU
        body["max_completion_tokens"] = 4
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = 3
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
