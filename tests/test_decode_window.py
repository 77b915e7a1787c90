"""advance_decode_window(k) must leave the scheduler exactly where k plain steps would."""
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.core import Request, SamplingParams, Scheduler, SchedulerConfig

TOKEN = 7


def state(s: Scheduler):
    kvm = s.kv_cache_manager
    return (
        [(r.request_id, r.num_computed_tokens, r.num_tokens, r.status, tuple(kvm.get_block_ids(r.request_id)))
         for r in s.running],
        [(r.request_id, r.num_computed_tokens, r.num_tokens, r.status) for r in s.waiting],
        [b.block_id for b in kvm.block_pool.free_queue],
        sorted((h, tuple(b.block_id for b in kvm.block_pool.cached_blocks(h))) for h in kvm.block_pool.cached),
        {rid: n for rid, n in kvm.num_cached_block.items()},
    )


def plain_step(s: Scheduler):
    out = s.schedule()
    sampled = {rid: [TOKEN] for rid in out.num_scheduled_tokens
               if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens}
    return s.update_from_output(out, sampled)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_window_equals_plain_steps(data):
    bs = data.draw(st.sampled_from([1, 2, 4, 16]))
    mml = data.draw(st.integers(32, 200))
    cfg = dict(max_num_batched_tokens=data.draw(st.integers(4, 300)),
               max_num_seqs=data.draw(st.integers(1, 10)), max_model_len=mml, block_size=bs,
               num_gpu_blocks=1 + -(-mml // bs) + data.draw(st.integers(0, 40)),
               enable_prefix_caching=data.draw(st.booleans()),
               reserve_full_prompt=data.draw(st.booleans()),
               policy=data.draw(st.sampled_from(["fcfs", "priority"])))
    a, b = Scheduler(SchedulerConfig(**cfg)), Scheduler(SchedulerConfig(**cfg))
    shared = [data.draw(st.integers(1, 3)) for _ in range(40)]
    reqs = []
    for i in range(data.draw(st.integers(1, 8))):
        plen = data.draw(st.integers(1, mml - 2))
        prompt = (shared + [100 + i] * plen)[:plen] if data.draw(st.booleans()) else [100 + i] * plen
        reqs.append((data.draw(st.integers(0, 40)), f"r{i}", prompt,
                     data.draw(st.integers(1, mml - plen)), data.draw(st.integers(0, 2))))
    arrivals = sorted({r[0] for r in reqs})
    max_window = data.draw(st.integers(2, 50))
    step_b = 0
    finished_a, finished_b = {}, {}
    windows = 0
    while step_b < 3000:
        for (t, rid, prompt, mt, prio) in reqs:
            if t == step_b:
                for s in (a, b):
                    s.add_request(Request(rid, prompt, SamplingParams(max_tokens=mt, ignore_eos=True),
                                          arrival_time=float(t), priority=prio))
        nxt = min([t for t in arrivals if t > step_b], default=10**9)
        k = b.decode_window(min(max_window, nxt - step_b), TOKEN)
        if k:
            windows += 1
            outs_b = b.advance_decode_window(k, TOKEN)
            for o in outs_b:
                finished_b[o.request_id] = (step_b + k - 1, o.finish_reason)
            for j in range(k):
                for o in plain_step(a):
                    if o.finish_reason:
                        finished_a[o.request_id] = (step_b + j, o.finish_reason)
            step_b += k
        else:
            for s, fin in ((a, finished_a), (b, finished_b)):
                for o in plain_step(s):
                    if o.finish_reason:
                        fin[o.request_id] = (step_b, o.finish_reason)
            step_b += 1
        assert state(a) == state(b), f"diverged after step {step_b}"
        b.check_invariants()
        if not a.has_unfinished_requests() and step_b > max(arrivals):
            break
    event(f"used windows: {windows > 0}")
    assert finished_a == finished_b and len(finished_a) == len(reqs)


def test_window_is_used_and_skips_steps():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512,
                                  block_size=16, num_gpu_blocks=200))
    for i in range(4):
        s.add_request(Request(f"r{i}", [i] * 20, SamplingParams(max_tokens=100, ignore_eos=True)))
    plain_step(s)
    k = s.decode_window(1000, TOKEN)
    assert k == 99  # each has 79 tokens... 100 outputs, 1 done: the 99th step finishes all
    outs = s.advance_decode_window(k, TOKEN)
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "r3"]
    assert all(o.finish_reason == "length" for o in outs)
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_free_blocks == 199
