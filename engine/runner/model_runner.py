"""The model runner: applies each SchedulerOutput diff to its per-request state, runs one forward
for the whole mixed batch (prefill chunks and decodes together) and samples.

The scheduler and the runner each keep their own copy of every request's tokens; only ids, token
counts and block-id deltas cross the seam (vLLM V1's design):

    new request       NewRequestData: prompt, block ids, prefix-cache hits (num_computed_tokens)
    resumed request   NewRequestData: prompt + outputs so far (recomputed), its whole new block list
    still running     CachedRequestData: blocks added this step, computed count before the step
    preempted         block list dropped (the state, and a seeded request's generator, stay)
    finished/aborted  state dropped

A request whose tokens are all computed after this step (its last prefill chunk, or a decode)
gets one logits row and one sampled token, which the runner appends to its own token list; a
non-final prefill chunk samples nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.attention import allocate_kv_cache, build_metadata, build_positions
from engine.core.output import SchedulerOutput
from engine.core.sampling_params import SamplingParams
from engine.model.llama import LlamaForCausalLM
from engine.prompt_embeds import PromptEmbeds
from engine.sampler import Sampler, TokenLogprobs, compute_logprobs, make_generator


PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits are computed at once (prompt_logprobs)


@dataclass(slots=True)
class RequestState:
    """The runner's view of one request (also the sampler's SamplingRow)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int            # tokens whose KV is in the cache
    min_tokens_stop_ids: tuple[int, ...]
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs
    # min_characters not yet reached by the output text (the engine clears it: `text_reached`)
    text_short: bool = False
    # prompt embeddings (engine.prompt_embeds): per prompt position, its row of embeds or -1
    embeds_index: torch.Tensor | None = None
    embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StepTimes:
    """Wall-clock split of the last `execute` (seconds)."""

    prepare_s: float = 0.0
    forward_s: float = 0.0   # forward + logits; CUDA-event time on GPU
    sample_s: float = 0.0


class ModelRunner:
    """Call `initialize_kv_cache(num_blocks)` (after any `profile_forward`) before `execute`."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        self.model = model
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.num_blocks = 0
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, RequestState] = {}
        self.sampler = Sampler(make_generator(seed, self.device))
        self.times = StepTimes()
        # Log-probabilities of the last step's sampled tokens, for requests that asked for them,
        # and of the prompt tokens its prefill chunks covered: req_id -> (first position, entries)
        # where entries[j] is the prompt token at first position + j given the tokens before it.
        self.logprobs: dict[str, TokenLogprobs] = {}
        self.prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        self._cuda = self.device.type == "cuda"
        # req_id -> (row index per prompt position, vectors on the device): kept from the engine's
        # add until the scheduler reports the request finished (a preempted request needs them again)
        self.embeds: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add_prompt_embeds(self, req_id: str, pe: PromptEmbeds, prompt_len: int) -> None:
        self.embeds[req_id] = (pe.row_index(prompt_len), pe.values.to(self.device, self.dtype))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        c = self.model.config
        self.num_blocks = num_blocks
        self.kv_caches = []  # free the old cache before allocating the new one
        self.kv_caches = allocate_kv_cache(c.num_layers, num_blocks, self.block_size, c.num_kv_heads,
                                           c.head_dim, self.dtype, self.device)

    # ------------------------------------------------------------------ state
    def _add(self, d, resumed: bool) -> None:
        sp = d.sampling_params
        old = self.requests.get(d.req_id) if resumed else None
        out_ids = list(d.output_token_ids)
        stop_ids = tuple(sp.stop_token_ids) if d.eos_token_id is None else (d.eos_token_id, *sp.stop_token_ids)
        if old is not None:
            gen = old.generator  # a seeded request keeps its random stream across preemption
        else:
            gen = make_generator(sp.seed, self.device) if sp.seed is not None else None
        index, vectors = self.embeds.get(d.req_id, (None, None))
        self.requests[d.req_id] = RequestState(
            req_id=d.req_id, prompt_token_ids=list(d.prompt_token_ids), output_token_ids=out_ids,
            sampling_params=sp, block_ids=list(d.block_ids), num_computed_tokens=d.num_computed_tokens,
            min_tokens_stop_ids=stop_ids, generator=gen, token_ids=list(d.prompt_token_ids) + out_ids,
            text_short=old.text_short if old is not None else sp.min_characters > 0,
            embeds_index=index, embeds=vectors)

    def text_reached(self, req_id: str) -> None:
        """The request's output text has min_characters characters: EOS and stop ids unmasked."""
        st = self.requests.get(req_id)
        if st is not None:
            st.text_short = False

    def update_states(self, out: SchedulerOutput) -> None:
        reqs = self.requests
        for rid in out.finished_req_ids:
            reqs.pop(rid, None)
            self.embeds.pop(rid, None)
        for rid in out.preempted_req_ids:
            st = reqs.get(rid)
            if st is not None:
                st.block_ids = []
                st.num_computed_tokens = 0
        for d in out.scheduled_new_reqs:
            self._add(d, resumed=False)
        for d in out.scheduled_resumed_reqs:
            self._add(d, resumed=True)
        c = out.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = reqs[rid]
            if new_blocks:
                st.block_ids.extend(new_blocks)
            st.num_computed_tokens = computed

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Run the step `out` describes; returns {req_id: [token]} for requests that sampled
        (and leaves the log-probabilities of those that asked for them in `self.logprobs`)."""
        t0 = time.perf_counter()
        self.update_states(out)
        if not out.num_scheduled_tokens:
            self.logprobs, self.prompt_logprobs = {}, {}
            self.times = StepTimes(prepare_s=time.perf_counter() - t0)
            return {}
        reqs = self.requests
        ids: list[int] = []
        block_ids: list[list[int]] = []
        computed: list[int] = []
        new: list[int] = []
        sample_rows: list[int] = []        # flattened row of each sampling request's last token
        sampling: list[RequestState] = []
        prompt_lp: list[tuple[RequestState, int, int, int]] = []  # (request, first row, first pos, rows)
        embed_rows: list[torch.Tensor] = []  # batch rows that take given vectors, and the vectors
        embed_values: list[torch.Tensor] = []
        row = 0
        # Which requests sample this step is the scheduler's call (final prefill chunks and
        # decodes); an output built by hand may leave it out, then it is derived the same way.
        samples = set(out.sampling_req_ids) if out.sampling_req_ids is not None else None
        for rid, n in out.num_scheduled_tokens.items():
            st = reqs[rid]
            c = st.num_computed_tokens
            ids.extend(st.token_ids[c:c + n])
            if st.embeds is not None and c < len(st.prompt_token_ids):
                idx = st.embeds_index[c:c + n]
                hit = (idx >= 0).nonzero().squeeze(1)
                if hit.numel():
                    embed_rows.append(hit + row)
                    embed_values.append(st.embeds[idx[hit].to(st.embeds.device)])
            block_ids.append(st.block_ids)
            computed.append(c)
            new.append(n)
            if st.sampling_params.prompt_logprobs is not None and c + 1 < len(st.prompt_token_ids):
                # rows c .. give the logits of prompt tokens c+1 .. (the last prompt row predicts
                # the first output, which the sampled logprobs cover)
                m = min(n, len(st.prompt_token_ids) - 1 - c)
                if m > 0:
                    prompt_lp.append((st, row, c + 1, m))
            row += n
            st.num_computed_tokens = c + n
            if (rid in samples) if samples is not None else c + n >= len(st.token_ids):
                sample_rows.append(row - 1)
                sampling.append(st)
        dev = self.device
        md = build_metadata(block_ids, computed, new, self.block_size, dev)
        positions = build_positions(computed, new, dev)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        rows_t = torch.tensor(sample_rows, dtype=torch.int64).to(dev, non_blocking=True) if sampling else None
        t1 = time.perf_counter()
        if self._cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        given = ((torch.cat(embed_rows).to(dev, non_blocking=True), torch.cat(embed_values))
                 if embed_rows else None)
        hidden = self.model(input_ids, positions, self.kv_caches, md, given)
        logits = self.model.compute_logits(hidden[rows_t]) if sampling else None
        if self._cuda:
            ev1.record()
        t2 = time.perf_counter()
        sampled: dict[str, list[int]] = {}
        self.logprobs = {}
        self.prompt_logprobs = {}
        for st, r0, p0, m in prompt_lp:
            # in slices: a long prompt's fp32 logits over a large vocabulary (and their softmax)
            # would otherwise take memory the KV pool was sized without
            k = st.sampling_params.prompt_logprobs
            entries: list[TokenLogprobs] = []
            for a in range(0, m, PROMPT_LOGITS_ROWS):
                b = min(m, a + PROMPT_LOGITS_ROWS)
                raw = self.model.compute_logits(hidden[r0 + a:r0 + b])
                entries += compute_logprobs(raw, st.prompt_token_ids[p0 + a:p0 + b], [k] * (b - a))
                del raw
            self.prompt_logprobs[st.req_id] = (p0, entries)
        if sampling:
            # Raw rows of the requests that want logprobs, kept before the sampler edits logits.
            lp_rows = [i for i, st in enumerate(sampling) if st.sampling_params.logprobs is not None]
            raw = logits[lp_rows].clone() if lp_rows else None
            toks = self.sampler(logits, sampling)
            if lp_rows:
                lps = compute_logprobs(raw, [toks[i] for i in lp_rows],
                                       [sampling[i].sampling_params.logprobs for i in lp_rows],
                                       [sampling[i].sampling_params.logprob_token_ids for i in lp_rows])
                self.logprobs = {sampling[i].req_id: lp for i, lp in zip(lp_rows, lps)}
            for st, tok in zip(sampling, toks):
                st.token_ids.append(tok)
                st.output_token_ids.append(tok)
                sampled[st.req_id] = [tok]
        t3 = time.perf_counter()
        if self._cuda:
            ev1.synchronize()
            fwd = ev0.elapsed_time(ev1) / 1e3
            # The sampler's .tolist() waited for the forward: charge only the rest to sampling.
            self.times = StepTimes(t1 - t0, fwd, max(0.0, (t3 - t1) - fwd))
        else:
            self.times = StepTimes(t1 - t0, t2 - t1, t3 - t2)
        return sampled

    # ------------------------------------------------------------------ profiling
    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, num_logit_rows: int) -> None:
        """A dummy forward of `num_tokens` prompt tokens plus `num_logit_rows` logits rows, for memory
        profiling. Uses a throw-away one-block cache (every position maps to block 0), so the real
        cache may be allocated afterwards."""
        c = self.model.config
        bs = self.block_size
        kv = allocate_kv_cache(c.num_layers, 1, bs, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        nblk = -(-num_tokens // bs)
        md = build_metadata([[0] * nblk], [0], [num_tokens], bs, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, kv, md)
        rows = min(num_logit_rows, num_tokens)
        logits = self.model.compute_logits(hidden[-rows:])
        logits.softmax(-1).sort(-1)  # the sampler's largest temporaries (top-k/top-p sort)
        del kv, hidden, logits
