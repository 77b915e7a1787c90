"""Per-request sampling and stopping parameters (the subset of vLLM's SamplingParams we honour)."""
from __future__ import annotations

from dataclasses import dataclass, field

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature == 0` is greedy. `top_k <= 0` (or -1) and `top_p == 1` disable those filters.
    `min_tokens` masks EOS and stop tokens until that many tokens were generated.
    `min_characters` (vLLM): the same until the output text has that many characters; stop
    strings count only from then on (the engine's detokenizer measures the text).
    `stop` strings are matched by the detokenizer (engine); `stop_token_ids` by the scheduler.
    `seed` is any integer in [-2**63, 2**64): all 64 bits select the random stream.
    `logprobs`: None, or how many most likely alternatives to report with each sampled token's
    log-probability (0 = the sampled token's only), at most `max_logprobs`. Log-probabilities are
    those of the model's raw distribution, before penalties, temperature and top-k/top-p (vLLM's
    default "raw_logprobs").
    `min_p` (vLLM): after temperature, tokens less likely than min_p x the most likely token's
    probability are dropped (0 disables it).
    `allowed_token_ids` (vLLM): only these tokens may be sampled (every other logit -inf first).
    `logit_bias`: token id -> a bias in [-100, 100] added to that token's logit before sampling
    (after the min_tokens mask, before penalties, as vLLM's logits processors run); log-probabilities
    stay those of the raw distribution.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    min_characters: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # None, or how many alternatives to report with each prompt token's log-probability (the
    # raw distribution at the position before it; the first prompt token has none). As in vLLM,
    # such a request reads nothing from the prefix cache: its whole prompt is computed.
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: these token ids' log-probabilities are the reported alternatives (in this order),
    # instead of the top `logprobs` (needs logprobs)
    logprob_token_ids: list[int] | None = None
    # the most alternatives logprobs / prompt_logprobs may ask for (vLLM's max_logprobs, a server
    # setting: MAX_LOGPROBS by default; -1: no limit, up to the whole vocabulary)
    max_logprobs: int = MAX_LOGPROBS
    # vLLM's thinking_token_budget: after the last reasoning start marker (reasoning_start_ids, in
    # the prompt or the output) at most this many tokens, then the end marker (reasoning_end_ids)
    # is forced, token by token; None: no limit
    thinking_token_budget: int | None = None
    reasoning_start_ids: tuple[int, ...] = ()
    reasoning_end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its value."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None for 'up to max_model_len')")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not _is_int(self.min_characters) or self.min_characters < 0:
            bad("min_characters", "must be an integer >= 0")
        if not _is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= 1, or 0/-1 to disable")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1] (0 disables it)")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of token ids (integers >= 0), or None")
        if not _is_num(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not _is_num(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0 (1 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), or None")
        if self.logprob_token_ids is not None:
            if not self.logprob_token_ids or not all(_is_int(t) and t >= 0 for t in self.logprob_token_ids):
                bad("logprob_token_ids", "must be a non-empty list of token ids (integers >= 0), or None")
            if self.logprobs is None:
                bad("logprob_token_ids", "`logprobs` must be set when using `logprob_token_ids` (their "
                    "log-probabilities are the alternatives reported)")
        if self.thinking_token_budget is not None:
            if not _is_int(self.thinking_token_budget) or self.thinking_token_budget < 0:
                bad("thinking_token_budget", "must be an integer >= 0, or None for no limit")
            if not self.reasoning_start_ids or not self.reasoning_end_ids:
                bad("thinking_token_budget", "needs the reasoning markers' token ids (reasoning_start_ids "
                    "and reasoning_end_ids)")
        if not _is_int(self.max_logprobs) or self.max_logprobs < -1:
            bad("max_logprobs", "must be an integer >= 0, or -1 for no limit")
        cap = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0 or (cap != -1 and v > cap)):
                bad(name, f"must be an integer in [0, {cap}], or None" if cap != -1
                    else "must be an integer >= 0, or None")
        for t, b in (self.logit_bias or {}).items():
            if not _is_int(t) or t < 0:
                bad("logit_bias", f"every key must be a token id (an integer >= 0), got {t!r}")
            if not _is_num(b) or not -100.0 <= b <= 100.0:
                bad("logit_bias", f"the bias of token {t} must be a number in [-100, 100], got {b!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                bad("stop_token_ids", f"every id must be an integer >= 0, got {t!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", f"every stop string must be a non-empty string, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
