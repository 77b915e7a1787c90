"""Reasoning parsers (vLLM's --reasoning-parser): a chat reply's thinking, between a start and an
end marker (`<think>` ... `</think>`), goes to the message's `reasoning` field, the rest to its
`content`.

Two of vLLM's parsers, the think-tag ones:
- `deepseek_r1`: everything before the end marker is reasoning (the start marker, which such
  templates often put in the prompt, is dropped where the reply has it); no end marker yet: all
  reasoning.
- `qwen3`: the same when the reply has the end marker; without it, a reply that opened with the
  start marker is reasoning (cut short), any other all content (thinking was off).
--reasoning-config's `reasoning_start_str` / `reasoning_end_str` set other markers. The markers
are matched in the text, so a tokenizer without them as single tokens works too (vLLM refuses to
start then); their token ids (the text tokenized) are what a request's thinking_token_budget
counts and forces (engine.sampler.forced_thinking_token).
"""
from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    start_ids: tuple[int, ...] = ()
    end_ids: tuple[int, ...] = ()

    @classmethod
    def build(cls, name: str, config: dict | None, tokenizer) -> ReasoningParser:
        """ValueError naming the flag for an unknown parser or a bad config."""
        if name not in PARSERS:
            raise ValueError(f"--reasoning-parser={name!r}: not one of {', '.join(PARSERS)}")
        config = dict(config or {})
        start = config.pop("reasoning_start_str", "<think>")
        end = config.pop("reasoning_end_str", "</think>")
        if config:
            raise ValueError(f"--reasoning-config: unknown key(s) {sorted(config)} (reasoning_start_str, "
                             "reasoning_end_str)")
        if not (isinstance(start, str) and isinstance(end, str) and start and end):
            raise ValueError("--reasoning-config: reasoning_start_str and reasoning_end_str must be non-empty strings")

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else ()
        return cls(name, start, end, ids(start), ids(end))

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None, int]:
        """(reasoning, content, held) of a reply's text so far: `held` trailing characters that
        may begin a marker are left out of both until more text (or the end, `final`) decides."""
        held = 0
        if not final:
            for marker in (self.end, self.start):
                for k in range(min(len(marker) - 1, len(text)), 0, -1):
                    if text.endswith(marker[:k]):
                        held = max(held, k)
                        break
            if self.name == "qwen3" and self.end not in text and self.start.startswith(text.lstrip()):
                held = len(text)  # the reply may still open with the start marker
        body = text[:len(text) - held]
        opened, _, rest = body.partition(self.start)
        after_start = rest if _ else body
        if self.end in after_start:
            reasoning, _, content = after_start.partition(self.end)
            return reasoning, content or None, held
        if self.name == "qwen3" and not _:
            return None, body or None, held
        return after_start, None, held

    def count_tokens(self, token_ids: list[int], reasoning: str | None, tokenizer) -> int:
        """The reply's reasoning tokens: with one-token markers, the ids between a start and an end
        marker (vLLM's count; deepseek_r1's reasoning opens in the prompt when the reply has no
        start marker); otherwise the reasoning text's tokens."""
        if len(self.start_ids) == 1 and len(self.end_ids) == 1:
            s, e = self.start_ids[0], self.end_ids[0]
            depth = 1 if self.name == "deepseek_r1" and s not in token_ids else 0
            count = 0
            for t in token_ids:
                if t == s:
                    depth += 1
                elif t == e:
                    depth = max(0, depth - 1)
                elif depth > 0:
                    count += 1
            return count
        return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
