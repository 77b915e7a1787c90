"""Request.unique_from (content no other request shares) lets the KV manager skip hashing blocks
no one else can hit, and the simulator skip building their token ids. Decisions must not change:
same steps, same blocks, same free queue, same prefix hits (a preempted request still hits its
own blocks), with and without the hint."""
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.core import Request, SamplingParams, Scheduler, SchedulerConfig
from sim.scenario import parse_scenario, run_scenario
from sim.workload import Workload
from tests.test_sim_fuzz import COLUMNS, random_scenario

TOKEN = 7


def decisions(s: Scheduler, out, outs):
    kvm = s.kv_cache_manager
    return (dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids),
            [(o.request_id, o.finish_reason) for o in outs],
            [(r.request_id, tuple(kvm.get_block_ids(r.request_id))) for r in s.running],
            [b.block_id for b in kvm.block_pool.free_queue],
            kvm.num_queried_tokens, kvm.num_hit_tokens, s.num_preemptions)


def draw_config(data) -> dict:
    """SchedulerConfig arguments for a small pool (at least one request of max_model_len fits)."""
    bs = data.draw(st.sampled_from([1, 4, 16]))
    mml = data.draw(st.integers(40, 200))
    return dict(max_num_batched_tokens=data.draw(st.integers(8, 256)),
                max_num_seqs=data.draw(st.integers(1, 8)), max_model_len=mml, block_size=bs,
                num_gpu_blocks=1 + -(-mml // bs) + data.draw(st.integers(0, 30)),
                long_prefill_token_threshold=data.draw(st.sampled_from([0, 16])),
                policy=data.draw(st.sampled_from(["fcfs", "priority"])))


def draw_requests(data, mml: int, leads: list[int]) -> list[tuple]:
    """1-8 requests (arrival step, id, prompt, unique_from, max_tokens, priority): each prompt
    starts with `lead` tokens of a prefix some others share (drawn from leads), then ids no
    other request has."""
    shared = [1, 2, 3] * 20  # 60 tokens some prompts start with
    reqs = []
    for i in range(data.draw(st.integers(1, 8))):
        plen = data.draw(st.integers(1, mml - 2))
        own = [100 + i] * plen  # ids no other request has
        lead = data.draw(st.sampled_from(leads))
        prompt = (shared[:lead] + own)[:plen]
        unique_from = min(lead, plen) if lead < plen else None
        reqs.append((data.draw(st.integers(0, 30)), f"r{i}", prompt, unique_from,
                     data.draw(st.integers(1, mml - plen)), data.draw(st.integers(0, 2))))
    return reqs


def run_side_by_side(pair, reqs, sides, decisions, after_step) -> None:
    """Drive two schedulers step by step with the same arrivals (draw_requests tuples) until
    both are done: `sides(prompt, unique_from)` gives each one's (prompt tokens, unique_from)
    for a request; every step's `decisions(scheduler, output, core outputs)` must be equal on
    both; `after_step()` runs after each step."""
    for k in range(3000):
        for (t, rid, prompt, unique_from, mt, prio) in reqs:
            if t == k:
                for s, (toks, hint) in zip(pair, sides(prompt, unique_from)):
                    r = Request(rid, list(toks), SamplingParams(max_tokens=mt, ignore_eos=True),
                                arrival_time=float(t), priority=prio)
                    r.unique_from = hint
                    s.add_request(r)
        got = []
        for s in pair:
            out = s.schedule()
            outs = s.update_from_output(out, dict.fromkeys(out.sampling_req_ids, [TOKEN]))
            got.append(decisions(s, out, outs))
        assert got[0] == got[1], f"step {k}"
        after_step()
        if not pair[0].has_unfinished_requests() and k > max(r[0] for r in reqs):
            break


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hint_changes_no_decision(data):
    cfg = draw_config(data)
    plain, hinted = Scheduler(SchedulerConfig(**cfg)), Scheduler(SchedulerConfig(**cfg))
    reqs = draw_requests(data, cfg["max_model_len"], leads=[0, 0, 20, 60])

    def sides(prompt, unique_from):
        # The hinted scheduler never reads tokens past unique_from: it gets zeros there.
        filler = prompt if unique_from is None else prompt[:unique_from] + [0] * (len(prompt) - unique_from)
        return (prompt, None), (filler, unique_from)
    run_side_by_side((plain, hinted), reqs, sides, decisions, hinted.check_invariants)
    event(f"preemptions: {plain.num_preemptions > 0}; hits: {plain.kv_cache_manager.num_hit_tokens > 0}")


def same_records_both_ways(base: dict, monkeypatch, cls, attr: str):
    """The scenario simulated with cls.attr True and then False: the request records and the step
    tables must be equal; returns both results (True first)."""
    results = {}
    for flag in (True, False):
        monkeypatch.setattr(cls, attr, flag)
        results[flag] = run_scenario(parse_scenario(base))
    a, b = results[True], results[False]
    assert a.requests[COLUMNS].equals(b.requests[COLUMNS])
    for c in a.step_table:
        assert (a.step_table[c] == b.step_table[c]).all(), c
    return a, b


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_hint_changes_no_simulated_record(seed, monkeypatch):
    a, b = same_records_both_ways(random_scenario(seed), monkeypatch, Workload, "unique_hints")
    assert a.summary["requests"]["preemptions"] == b.summary["requests"]["preemptions"]


def test_workload_finds_the_first_token_no_other_request_has():
    from sim.workload import RequestSpec
    specs = [RequestSpec("a", 0.0, 30, 5, ((10, 30),)),             # overlaps b's range
             RequestSpec("b", 0.1, 10, 5, ((20, 10),)),
             RequestSpec("c", 0.2, 30, 5, ((500, 10), (600, 20))),  # shared head, own tail
             RequestSpec("d", 0.3, 20, 5, ((500, 10), (700, 10))),
             RequestSpec("e", 0.4, 10, 5, ((500, 10),))]            # nothing of its own
    wl = Workload.from_requests(specs)
    assert wl.unique_from().tolist() == [-1, -1, 10, 10, -1]
    assert [s.unique_from for s in wl] == [None, None, 10, 10, None]
    rng = random.Random(0)
    assert wl[rng.choice([2, 3])].unique_from == 10


def test_token_sequence_keeps_the_shared_head_and_fills_the_rest():
    """The scheduler's view of a prompt: the real ids before unique_from, a filler of zeros from
    there (never read), prompt_len long in every case."""
    from sim.workload import RequestSpec
    whole = RequestSpec("a", 0.0, 5, 1, ((40, 5),))
    assert list(whole.token_sequence()) == [40, 41, 42, 43, 44]  # no hint: the real ids
    own = RequestSpec("b", 0.0, 5, 1, ((40, 5),), unique_from=0)
    assert own.token_sequence() == [0, 0, 0, 0, 0]
    tail = RequestSpec("c", 0.0, 6, 1, ((500, 2), (600, 1), (700, 3)), unique_from=3)
    assert tail.token_sequence() == [500, 501, 600, 0, 0, 0]
    assert tail.token_sequence()[:3] == tail.token_ids()[:3]
