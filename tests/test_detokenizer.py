"""Incremental detokenization (complete characters only) and stop strings across token boundaries,
with the default model's tokenizer."""
from __future__ import annotations

import pytest

import transformers  # noqa: E402  (make test installs it)

from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.detokenizer import IncrementalDetokenizer, find_stop_string  # noqa: E402
from engine.model.loader import resolve_model  # noqa: E402

TEXTS = [
    " The quick brown fox jumps over the lazy dog.",
    "\ndef f(x):\n    return x ** 2  # square\n",
    " 你好，世界！今天天气很好。我们去公园散步吧。",
    " Emoji: 🎉🚀👩‍💻 and accents: café, naïve, Zürich.",
    " 日本語のテキストと한국어 텍스트, mixed with English.",
]


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(resolve_model("default")), local_files_only=True)


def feed(tok, prompt: str, text: str, params: SamplingParams | None = None):
    """Feed `text`'s tokens one at a time; return (detokenizer, visible texts, stop string)."""
    d = IncrementalDetokenizer(tok, tok(prompt).input_ids, params or SamplingParams())
    shown = []
    for t in tok(text, add_special_tokens=False).input_ids:
        stop = d.update([t])
        shown.append(d.get_text(finished=stop is not None))
        if stop is not None:
            return d, shown, stop
    return d, shown, None


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_emits_partial_chars(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    d, shown, _ = feed(tok, "Some prompt:", text)
    assert d.output_text == tok.decode(ids, skip_special_tokens=True) == text
    for a, b in zip(shown, shown[1:]):
        assert b.startswith(a)  # text only grows
    assert all("\ufffd" not in s for s in shown)


def test_multi_token_characters_are_held_until_complete(tok):
    ids = tok(" 🎉", add_special_tokens=False).input_ids
    assert len(ids) >= 2  # one emoji, several byte-level tokens
    d = IncrementalDetokenizer(tok, tok("Party").input_ids, SamplingParams())
    for t in ids[:-1]:
        d.update([t])
        assert d.output_text.strip() == ""
    d.update(ids[-1:])
    assert d.output_text == " 🎉"


def test_special_tokens_skipped(tok):
    ids = tok(" Hello there", add_special_tokens=False).input_ids + [tok.eos_token_id]
    d = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams())
    d.update(ids)
    assert d.output_text == " Hello there"
    # EOS that stopped the request is not detokenized either way
    d2 = IncrementalDetokenizer(tok, [1, 2, 3], SamplingParams())
    d2.update(ids, stop_terminated=True)
    assert d2.output_text == " Hello there"


def test_stop_string_spanning_tokens_stops_and_trims(tok):
    text = " The answer is forty-two, and that is final."
    stop = "forty-two"
    ids = tok(text, add_special_tokens=False).input_ids
    pieces = [tok.decode([t]) for t in ids]
    assert not any(stop in p for p in pieces)  # the stop string spans several tokens
    d, shown, hit = feed(tok, "Q:", text, SamplingParams(stop=[stop]))
    assert hit == stop and d.output_text == " The answer is "
    # nothing of the stop string was ever visible before the match
    assert all("forty" not in s and not s.endswith("fo") for s in shown)
    d, _, hit = feed(tok, "Q:", text, SamplingParams(stop=["zzz", stop], include_stop_str_in_output=True))
    assert hit == stop and d.output_text == " The answer is forty-two"


def test_stop_string_held_back_then_released(tok):
    # "fort" could start "forty-two" and is held back; the text then diverges, and it is shown.
    d, shown, hit = feed(tok, "Q:", " a fortress stands", SamplingParams(stop=["forty-two"]))
    assert hit is None
    assert len(shown[-1]) == len(d.output_text) - len("forty-two") + 1
    assert d.get_text(finished=True) == " a fortress stands"


def test_stop_string_in_chinese(tok):
    d, _, hit = feed(tok, "说：", " 我们去公园散步吧。然后回家。", SamplingParams(stop=["散步"]))
    assert hit == "散步" and d.output_text == " 我们去公园"


def test_stop_strings_respect_min_tokens(tok):
    text = " stop here and then stop again"
    n_first = len(tok(" stop", add_special_tokens=False).input_ids)
    d, _, hit = feed(tok, "x", text, SamplingParams(stop=["stop"], min_tokens=n_first + 1, max_tokens=50))
    assert hit == "stop" and d.output_text == " stop here and then "


def test_stop_strings_respect_min_characters(tok):
    text = " stop here and then stop again"
    d, _, hit = feed(tok, "x", text, SamplingParams(stop=["stop"], min_characters=len(" stop h"), max_tokens=50))
    assert hit == "stop" and d.output_text == " stop here and then "
    d, _, hit = feed(tok, "x", text, SamplingParams(stop=["stop"], max_tokens=50))
    assert hit == "stop" and d.output_text == " "


def test_find_stop_string():
    assert find_stop_string("abcXYZ", 2, ["XYZ"], False) == ("XYZ", 3)
    assert find_stop_string("abcXYZ", 2, ["XYZ"], True) == ("XYZ", -1)
    assert find_stop_string("XYZabc", 2, ["XYZ"], False) is None  # ended before the new text
    assert find_stop_string("abcXYZd", 2, ["XYZ"], True) == ("XYZ", 6)  # new text "Zd"
    assert find_stop_string("abcXYZd", 1, ["XYZ"], True) is None  # only "d" is new
    assert find_stop_string("abc", 0, ["c"], False) is None
