"""FastForwardScheduler.advance() (fast-forward steps) must leave the scheduler exactly where plain
steps of the plain Scheduler would."""
import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ast
from pathlib import Path

from engine.core import FastForwardScheduler, Request, SamplingParams, Scheduler, SchedulerConfig

TOKEN = 7


def state(s: Scheduler):
    kvm = s.kv_cache_manager
    return (
        [(r.request_id, r.num_computed_tokens, r.num_tokens, len(r.all_token_ids), r.output_token_ids[-3:],
          r.status, tuple(kvm.get_block_ids(r.request_id))) for r in s.running],
        [(r.request_id, r.num_computed_tokens, r.num_tokens, r.status) for r in s.waiting],
        [b.block_id for b in kvm.block_pool.free_queue],
        sorted((h, tuple(b.block_id for b in kvm.block_pool.cached_blocks(h))) for h in kvm.block_pool.cached),
        dict(kvm.num_cached_block), kvm.num_queried_tokens, kvm.num_hit_tokens, s.num_preemptions,
        [b.block_hash is None for b in kvm.block_pool.blocks],  # cached (hashed or UNIQUE) or not
    )


def plain_step(s: Scheduler):
    out = s.schedule()
    outs = s.update_from_output(out, dict.fromkeys(out.sampling_req_ids, [TOKEN]))
    return out, outs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_steady_steps_equal_plain_steps(data):
    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    mml = data.draw(st.integers(32, 240))
    cfg = dict(max_num_batched_tokens=data.draw(st.integers(4, 300)),
               max_num_seqs=data.draw(st.integers(1, 10)), max_model_len=mml, block_size=bs,
               num_gpu_blocks=1 + -(-mml // bs) + data.draw(st.integers(0, 40)),
               enable_prefix_caching=data.draw(st.booleans()),
               reserve_full_prompt=data.draw(st.booleans()),
               long_prefill_token_threshold=data.draw(st.sampled_from([0, 0, 8, 40])),
               policy=data.draw(st.sampled_from(["fcfs", "priority"])))
    a, b = Scheduler(SchedulerConfig(**cfg)), FastForwardScheduler(SchedulerConfig(**cfg))
    shared = [data.draw(st.integers(1, 3)) for _ in range(40)]
    reqs = []
    uniques = {}
    for i in range(data.draw(st.integers(1, 10))):
        plen = data.draw(st.integers(1, mml - 2))
        lead = 40 if data.draw(st.booleans()) else 0
        prompt = (shared[:lead] + [100 + i] * plen)[:plen]
        # Token 100 + i is request i's own: a true Request.unique_from (given to half of them).
        unique_from = lead if lead < plen and data.draw(st.booleans()) else None
        uniques[f"r{i}"] = unique_from
        if unique_from is not None:  # its tokens from there on are never read: zeros
            prompt = prompt[:unique_from] + [0] * (plen - unique_from)
        stops = data.draw(st.sampled_from([(), (), (TOKEN,)]))  # the fixed token may stop some
        reqs.append((data.draw(st.integers(0, 60)), f"r{i}", prompt,
                     data.draw(st.integers(1, mml - plen)), data.draw(st.integers(0, 2)),
                     (stops, data.draw(st.integers(0, 4))),
                     data.draw(st.one_of(st.none(), st.integers(0, 80)))))
    rng = random.Random(data.draw(st.integers(0, 1000)))

    def watch(r):  # a driver watch point partway through some requests (it must not change anything)
        return r.num_prompt_tokens + 3 if int(r.request_id[1:]) % 2 else None
    fast_steps = 0
    fin_a, fin_b = {}, {}
    for k in range(3000):
        aborts = [rid for (t, rid, *_rest, ab) in reqs if ab == k and t <= k]
        for (t, rid, prompt, mt, prio, (stops, min_toks), _) in reqs:
            if t == k:
                for s in (a, b):
                    r = Request(rid, list(prompt), SamplingParams(
                        max_tokens=mt, ignore_eos=True, stop_token_ids=list(stops),
                        min_tokens=min(min_toks, mt)), arrival_time=float(t), priority=prio)
                    r.unique_from = uniques[rid]
                    s.add_request(r)
        if aborts:
            from engine.core import RequestStatus
            a.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
            b.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)  # lazy or not
        _, outs = plain_step(a)
        for o in outs:
            if o.finish_reason:
                fin_a[o.request_id] = (k, o.finish_reason)
        adv = None
        if rng.random() < 0.8:
            # One step of one unit: the clock starts at k and the next outside event is at k + 1.
            adv = b.advance(TOKEN, lambda f: 1.0, float(k), float(k + 1), watch=watch)
        took = adv is not None and adv.num_steps == 1
        if took:
            fast_steps += 1
            assert adv.ends == [k + 1.0]
            for ev in adv.events:
                for r, reason in ev.finished:
                    fin_b[r.request_id] = (k, reason)
        else:
            _, outs = plain_step(b)
            for o in outs:
                if o.finish_reason:
                    fin_b[o.request_id] = (k, o.finish_reason)
        # Compare: write back at random points (fast mode goes on after that).
        if not took or rng.random() < 0.3:
            b.sync()
            assert state(a) == state(b), f"diverged at step {k}"
            b.check_invariants()
        if not a.has_unfinished_requests() and k > max(r[0] for r in reqs):
            break
    b.sync()
    assert state(a) == state(b)
    assert fin_a == fin_b
    event(f"fast steps > 0: {fast_steps > 0}")


def test_advance_features_and_admission():
    s = FastForwardScheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512,
                                  block_size=16, num_gpu_blocks=200))
    for i in range(3):
        s.add_request(Request(f"r{i}", [i] * 20, SamplingParams(max_tokens=50, ignore_eos=True)))
    plain_step(s)
    one = lambda f: 1.0  # noqa: E731
    adv = s.advance(TOKEN, one, 0.0, 1.0)
    assert adv.num_decodes == [3] and adv.features.decode_context_tokens == 3 * 21
    assert [r.request_id for r in adv.entered] == ["r0", "r1", "r2"] and not adv.events
    s.add_request(Request("new", [9] * 30, SamplingParams(max_tokens=5, ignore_eos=True)))
    adv = s.advance(TOKEN, one, 1.0, 2.0)
    (ev,) = adv.events
    assert [a[0].request_id for a in ev.admitted] == ["new"] and ev.features.prefill_chunks == [(30, 0)]
    assert [r.request_id for r in ev.first_tokens] == ["new"]
    assert adv.features.decode_context_tokens == 3 * 22 and adv.features.num_prefill_tokens == 30
    assert adv.entered == []
    adv = s.advance(TOKEN, one, 2.0, 3.0)
    assert adv.num_decodes == [4]
    s.sync()
    assert [r.num_tokens for r in s.running] == [20 + 4, 20 + 4, 20 + 4, 30 + 2]
    s.check_invariants()


def test_advance_runs_until_the_outside_event_and_stops_at_a_finish():
    s = FastForwardScheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512,
                                  block_size=4, num_gpu_blocks=200))
    s.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=100, ignore_eos=True)))
    s.add_request(Request("b", [2] * 10, SamplingParams(max_tokens=8, ignore_eos=True)))
    plain_step(s)  # both prompts, one token each
    adv = s.advance(TOKEN, lambda f: 0.5, 10.0, 12.0)  # until 12.0: four steps of 0.5
    assert adv.ends == [10.5, 11.0, 11.5, 12.0] and adv.left is None
    assert adv.features.num_decode_reqs == 8 and adv.features.num_reqs == 8
    # KV read: a and b compute positions 10..13, each reading itself and what precedes it
    assert adv.features.decode_context_tokens == 2 * (11 + 12 + 13 + 14)
    # b has 5 tokens; it samples its 8th in the third step from here, and the run stops there.
    adv = s.advance(TOKEN, lambda f: 0.5, 12.0, 100.0)
    assert adv.num_decodes == [2, 2, 2]
    (ev,) = adv.events
    assert ev.index == 2 and [(r.request_id, why) for r, why in ev.finished] == [("b", "length")]
    assert len(ev.finished[0][0].output_token_ids) == 8
    s.sync()
    (a,) = s.running
    assert a.num_tokens == 10 + 8 and a.num_computed_tokens == 17 and a.output_token_ids == [TOKEN] * 8
    # Blocks of 4 tokens: 17 computed tokens occupy 5 blocks.
    assert len(s.kv_cache_manager.get_block_ids("a")) == 5
    s.check_invariants()


def test_advance_then_takes_that_many_steps_past_until():
    """Steps of 1.0 from 0.0 with until=2.5: steps start at 0, 1, 2 (the last one ends at 3.0,
    past until); then=1 adds the step starting at 3.0, then=2 two; a finish still stops the run."""
    def fresh(max_tokens=50):
        s = FastForwardScheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512,
                                      block_size=16, num_gpu_blocks=200))
        s.add_request(Request("r", [1] * 20, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        plain_step(s)
        return s
    one = lambda f: 1.0  # noqa: E731
    assert fresh().advance(TOKEN, one, 0.0, 2.5).ends == [1.0, 2.0, 3.0]
    assert fresh().advance(TOKEN, one, 0.0, 2.5, then=1).ends == [1.0, 2.0, 3.0, 4.0]
    assert fresh().advance(TOKEN, one, 0.0, 2.5, then=2).ends == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert fresh().advance(TOKEN, one, 0.0, 0.0, then=1).ends == [1.0]  # until already reached: one step
    # max_tokens=4: the prefill gave token 1, tokens 2-4 end the request at the third step.
    assert fresh(4).advance(TOKEN, one, 0.0, 2.5, then=2).ends == [1.0, 2.0, 3.0]


def test_arrivals_join_a_run_through_the_arrive_hook():
    """An arrival handed in by advance()'s `arrive` hook is admitted at the step boundary where the
    hook takes it, exactly as if the run had stopped there and the driver had added it: same step
    ends, same scheduler state. The hook sees each boundary that reached its time once, with the
    start of the step that just ended."""
    def fresh():
        s = FastForwardScheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512,
                                      block_size=4, num_gpu_blocks=200))
        s.add_request(Request("a", [1] * 10, SamplingParams(max_tokens=40, ignore_eos=True)))
        plain_step(s)
        return s

    def arrival():
        return Request("b", [2] * 9, SamplingParams(max_tokens=5, ignore_eos=True))

    one = lambda f: 1.0  # noqa: E731
    calls = []

    def arrive(last_start, now):
        calls.append((last_start, now))
        if now >= 3.0:  # "b" came at 1.5 (during the step from 1.0); asynchronous admission
            s.add_request(arrival())  # takes it once the step that started after it has ended
            return float("inf")
        return 1.5

    s = fresh()
    adv = s.advance(TOKEN, one, 0.0, 20.0, stop_at_finish=False, arrive=arrive, arrive_at=1.5)
    assert calls == [(1.0, 2.0), (2.0, 3.0)]
    # Reference: stop at 3.0, add "b", go on.
    r = fresh()
    ref = r.advance(TOKEN, one, 0.0, 3.0)
    r.add_request(arrival())
    ref2 = r.advance(TOKEN, one, 3.0, 20.0, stop_at_finish=False)
    assert adv.ends == ref.ends + ref2.ends
    assert [(e.index, [a[0].request_id for a in e.admitted]) for e in adv.events if e.admitted] == [(3, ["b"])]
    s.sync()
    r.sync()
    assert state(s) == state(r)
    s.check_invariants()


def test_the_scheduler_module_is_the_plain_scheduler():
    # The fast-forward lives in engine/core/fast_forward.py and extends the plain scheduler through
    # its public hooks; scheduler.py neither imports it nor defines anything of it.
    src = (Path(__file__).resolve().parents[1] / "engine" / "core" / "scheduler.py").read_text()
    tree = ast.parse(src)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "engine.core.fast_forward" not in imported
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"advance", "sync", "Advance", "Cut", "FastStep", "LazyDecodes"}
    assert not hasattr(Scheduler, "advance") and issubclass(FastForwardScheduler, Scheduler)
