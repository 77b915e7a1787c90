"""Incremental detokenization and stop strings, one object per request.

Text is produced the way vLLM's incremental detokenizer does it, with two offsets into the list of
token strings (prompt tail + outputs):

    tokens:  ... p p p | o o o | o o
                 ^prefix_offset ^read_offset

Each new token decodes tokens[prefix_offset:] and tokens[prefix_offset:read_offset]; the
difference is the new text. Decoding with a little context in front keeps leading spaces and
merges right, and if the new text ends in U+FFFD (a multi-byte character, e.g. Chinese or an
emoji, split over tokens) nothing is emitted and the offsets stay put until the character is
complete.

Stop strings are searched only in the region new text could have completed (a stop string may
span tokens). Until the request finishes, the last `max(len(stop)) - 1` characters are held back,
since they may be the start of a stop string; on a match the text is cut before the stop string
(or after it, with include_stop_str_in_output).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.core.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough context for spaces and merges.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """(stop string, index to truncate `text` at; -1 = keep all) if one ends in the new text."""
    if not num_new_chars or not stop:
        return None
    for s in stop:
        # A match must end inside the new characters; it may start before them.
        at = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if at == -1:
            continue
        if include_stop_str_in_output:
            at += len(s)
            if at >= len(text):
                return s, -1
        return s, at
    return None


class IncrementalDetokenizer:
    """Per-request text state. `update(new_token_ids)` returns the stop string that matched, if any."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.min_characters = params.min_characters
        # Characters held back while they could still become a stop string.
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self.output_text = ""
        self.num_output_tokens = 0
        if tokenizer is None:
            self.tokens: list[str] = []
            self.prefix_offset = self.read_offset = 0
            return
        # Context from the prompt tail (never emitted).
        tail = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS - 2:])
        self.tokens = list(tokenizer.convert_ids_to_tokens(tail, skip_special_tokens=skip_special_tokens))
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - PROMPT_CONTEXT_TOKENS, 0)

    def _decode_one(self, token_id: int) -> str:
        tok = self.tokenizer
        new = tok.convert_ids_to_tokens([token_id], skip_special_tokens=self.skip_special_tokens)
        if not new:
            return ""  # a skipped special token
        tokens = self.tokens
        tokens.extend(new)
        prefix = tok.convert_tokens_to_string(tokens[self.prefix_offset:self.read_offset])
        full = tok.convert_tokens_to_string(tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            # Incomplete multi-byte character (or nothing new): wait for more tokens.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(tokens)
        return full[len(prefix):]

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add tokens; return the matched stop string (text already truncated) or None.

        `stop_terminated`: the last token stopped the request (EOS or a stop token id); as in vLLM
        its text is not added unless include_stop_str_in_output.
        """
        self.num_output_tokens += len(new_token_ids)
        if self.tokenizer is None:
            return None
        if stop_terminated and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        before = len(self.output_text)
        stop_checked_from = self.num_output_tokens - len(new_token_ids)
        for k, tid in enumerate(new_token_ids):
            piece = self._decode_one(tid)
            if not piece:
                continue
            self.output_text += piece
            # Stop strings count only once min_tokens outputs exist (vLLM), and min_characters
            # characters of text.
            if (self.stop and stop_checked_from + k + 1 > self.min_tokens
                    and len(self.output_text) >= self.min_characters):
                hit = find_stop_string(self.output_text, len(self.output_text) - before,
                                       self.stop, self.include_stop)
                if hit is not None:
                    s, cut = hit
                    if cut != -1:
                        self.output_text = self.output_text[:cut]
                    return s
        return None

    def get_text(self, finished: bool) -> str:
        """Text safe to show: everything when finished, else minus a possible stop-string prefix."""
        if finished or not self.stop_buffer:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.stop_buffer)]
