"""Property tests: random configs, random arrivals, aborts and sampled tokens."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from engine.core.output import features_from_requests

EOS = 0


@st.composite
def configs(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 160))
    fit = -(-max_model_len // bs)  # blocks for one max_model_len request
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 256)) if chunked else draw(st.integers(max(max_model_len, bs), 400))
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 12)),
        max_model_len=max_model_len,
        block_size=bs,
        num_gpu_blocks=1 + fit + draw(st.integers(0, 24)),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 17, 64])),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority", "shortest_prompt_first"])),
        reserve_full_prompt=draw(st.booleans()),
        unhashed_blocks_first=draw(st.booleans()),
    )


@st.composite
def workloads(draw, cfg):
    n = draw(st.integers(1, 14))
    prefixes = [[draw(st.integers(1, 5)) for _ in range(draw(st.integers(0, 40)))] for _ in range(2)]
    reqs = []
    for i in range(n):
        prefix = draw(st.sampled_from(prefixes + [[]]))[: cfg.max_model_len - 1]
        tail_len = draw(st.integers(1, cfg.max_model_len - len(prefix)))  # up to max_model_len
        prompt = prefix + [draw(st.integers(1, 9))] * tail_len
        reqs.append(dict(
            id=f"r{i}", prompt=prompt, step=draw(st.integers(0, 30)),
            max_tokens=draw(st.integers(1, 40)), priority=draw(st.integers(0, 3)),
            ignore_eos=draw(st.booleans()),
            abort_at=draw(st.one_of(st.none(), st.integers(0, 60))),
        ))
    tokens = draw(st.lists(st.integers(0, 30), min_size=1, max_size=50))  # 0 is EOS
    return reqs, tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_streams_hold_invariants(data):
    cfg = data.draw(configs())
    reqs, tokens = data.draw(workloads(cfg))
    s = Scheduler(cfg)
    outputs: dict[str, list[int]] = {r["id"]: [] for r in reqs}
    reasons: dict[str, str] = {}
    preempted_ever: set[str] = set()
    tok_i = 0
    for k in range(3000):
        for r in reqs:
            if r["step"] == k:
                s.add_request(Request(r["id"], r["prompt"], SamplingParams(
                    max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]),
                    arrival_time=float(k), priority=r["priority"], eos_token_id=EOS))
            if r["abort_at"] == k and r["step"] <= k:
                s.finish_requests([r["id"]], RequestStatus.FINISHED_ABORTED)
                reasons.setdefault(r["id"], "abort")
        out = s.schedule()
        # Budget and max_num_seqs are never exceeded; each scheduled request advances.
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        preempted_ever |= out.preempted_req_ids
        # Features and sampling rows gathered by schedule() equal those recomputed from state.
        # (as multisets of chunks: a priority victim refunded this step leaves and re-enters
        # the order the chunks were gathered in, which no cost model reads)
        got, want = out.features, features_from_requests(out, s.requests)
        assert sorted(got.prefill_chunks) == sorted(want.prefill_chunks)
        assert dataclasses.replace(got, prefill_chunks=[]) == dataclasses.replace(want, prefill_chunks=[])
        assert out.sampling_req_ids == [rid for rid in out.num_scheduled_tokens
                                        if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens]
        sampled = {}
        for rid in out.num_scheduled_tokens:
            req = s.requests[rid]
            assert req.num_computed_tokens <= req.num_tokens
            if req.num_computed_tokens == req.num_tokens:
                sampled[rid] = [tokens[tok_i % len(tokens)]]
                tok_i += 1
        for o in s.update_from_output(out, sampled):
            outputs[o.request_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
        # Ref counts equal the number of requests holding each block; queue state consistent.
        s.check_invariants()
        if not s.has_unfinished_requests() and k > 30:
            break
    # Every request finishes (the pool holds one max_model_len request).
    assert not s.has_unfinished_requests(), f"stuck: {s.running} {list(s.waiting)}"
    assert s.kv_cache_manager.num_free_blocks == cfg.num_gpu_blocks - 1
    for r in reqs:
        rid, got = r["id"], outputs[r["id"]]
        assert rid in reasons
        if reasons[rid] == "abort":
            continue
        cap = max(1, min(r["max_tokens"], cfg.max_model_len - len(r["prompt"])))
        if reasons[rid] == "length":
            assert len(got) == cap, (rid, len(got), cap, rid in preempted_ever)
        else:
            assert reasons[rid] == "stop" and not r["ignore_eos"] and got[-1] == EOS
            assert len(got) <= cap and EOS not in got[:-1]


@settings(max_examples=40, deadline=None)
@given(n_req=st.integers(2, 6), max_tokens=st.integers(5, 60), seed=st.integers(0, 10_000))
def test_preempted_requests_end_with_exactly_max_tokens(n_req, max_tokens, seed):
    # A pool that holds one full request but not all of them: preemption is forced.
    bs = 4
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128,
                          block_size=bs, num_gpu_blocks=1 + 32, enable_prefix_caching=bool(seed % 2))
    s = Scheduler(cfg)
    for i in range(n_req):
        s.add_request(Request(f"r{i}", [(seed + i * 7 + j) % 50 + 1 for j in range(40 + i)],
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    outs = {f"r{i}": [] for i in range(n_req)}
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = {rid: [len(outs[rid]) + 1000] for rid in out.num_scheduled_tokens
                   if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens}
        for o in s.update_from_output(out, sampled):
            outs[o.request_id] += o.new_token_ids
        steps += 1
        assert steps < 10_000
    # Each output is the next index: no token lost or duplicated across preemptions.
    for rid, got in outs.items():
        assert got == [1000 + j for j in range(max_tokens)], rid
    assert s.kv_cache_manager.num_free_blocks == 32


def run_tracking_written_kv(s: Scheduler, arrivals: dict, bs: int) -> None:
    """Drive `s`, tracking which KV slots steps really computed (from the scheduler's own
    outputs), and assert every prefix-cache hit is on fully computed blocks."""
    written: dict[int, set[int]] = {}
    for k in range(400):
        for r in arrivals.get(k, ()):
            s.add_request(r)
        if not s.has_unfinished_requests():
            if k > max(arrivals, default=0):
                break
            continue
        out = s.schedule()
        admitted = out.scheduled_new_reqs + out.scheduled_resumed_reqs
        for d in admitted:  # blocks allocated this step start empty
            for bid in d.block_ids[d.num_computed_tokens // bs:]:
                written[bid] = set()
        for bids in out.scheduled_cached_reqs.new_block_ids:
            for bid in bids:
                written[bid] = set()
        # This step's forward writes the KV of every scheduled token (each layer writes before
        # it attends, so a hit on a block computed in the same step is fine) ...
        for rid, n in out.num_scheduled_tokens.items():
            r = s.requests[rid]
            blocks = s.kv_cache_manager.get_block_ids(rid)
            for pos in range(r.num_computed_tokens - n, r.num_computed_tokens):
                written[blocks[pos // bs]].add(pos % bs)
        # ... and a hit must be on KV that this or an earlier step wrote in full.
        for d in admitted:
            for bid in d.block_ids[:d.num_computed_tokens // bs]:
                assert len(written.get(bid, ())) == bs, f"step {k}: {d.req_id} hit block {bid}, never computed"
        s.update_from_output(out, dict.fromkeys(out.sampling_req_ids, [7]))


def _random_priority_case(rng, policy="priority", uncache=True):
    bs = rng.choice([2, 4])
    mml = 64
    cfg = SchedulerConfig(max_num_batched_tokens=rng.randint(4, 40), max_num_seqs=rng.randint(2, 6),
                          max_model_len=mml, block_size=bs, num_gpu_blocks=1 + mml // bs + rng.randint(0, 10),
                          policy=policy, long_prefill_token_threshold=rng.choice([0, 4]),
                          uncache_unscheduled_victims=uncache)
    shared = list(range(500, 560))
    arrivals = {}
    for i in range(rng.randint(2, 8)):
        plen = rng.randint(2, 40)
        prompt = shared[:plen] if rng.random() < 0.6 else [100 + i] * plen
        arrivals.setdefault(rng.randint(0, 30), []).append(Request(
            f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, mml - plen - 1), ignore_eos=True),
            arrival_time=rng.random(), priority=rng.randint(0, 3)))
    return Scheduler(cfg), arrivals, bs


def test_prefix_hits_only_cover_computed_kv():
    """Every block a new or resumed request gets as a prefix-cache hit holds KV some step really
    computed. Priority preemption that un-schedules an already scheduled victim must not leave
    its never-computed blocks in the cache (seed 332 was such a case; 600 more random ones)."""
    import random
    for seed in [332] + list(range(1000, 1600)):
        rng = random.Random(seed)
        s, arrivals, bs = _random_priority_case(rng, "priority" if seed % 3 else "fcfs")
        run_tracking_written_kv(s, arrivals, bs)


def test_vllm_default_keeps_uncomputed_victim_blocks_cached():
    # The same seed-332 case with vLLM's behaviour (the default): the resumed victim hits a block
    # its un-scheduled chunk never computed. The switch exists because of this.
    import random
    s, arrivals, bs = _random_priority_case(random.Random(332), uncache=False)
    with pytest.raises(AssertionError, match="never computed"):
        run_tracking_written_kv(s, arrivals, bs)
