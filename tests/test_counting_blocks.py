"""SchedulerConfig.track_block_ids=False (the simulator): the KV pool counts blocks while no
prefix-cache hit is possible, and gives them identities when one becomes possible (a request
whose prompt may share content, or a preemption). Which block a request holds must never change
a decision: same steps, same preemptions, same block counts, same prefix hits, same simulated
records and step tables as with tracked block ids."""
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.core import Request, SamplingParams, Scheduler, SchedulerConfig
from engine.core.block_pool import ANONYMOUS, UNIQUE
from sim.replica import Replica
from tests.test_sim_fuzz import random_scenario
from tests.test_unique_hints import draw_config, draw_requests, run_side_by_side, same_records_both_ways

TOKEN = 7


def decisions(s: Scheduler, out, outs):
    kvm = s.kv_cache_manager
    return (dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids),
            [(o.request_id, o.finish_reason) for o in outs],
            [(r.request_id, r.num_computed_tokens, len(kvm.get_block_ids(r.request_id))) for r in s.running],
            [r.request_id for r in s.waiting],
            kvm.num_free_blocks, kvm.num_queried_tokens, kvm.num_hit_tokens, s.num_preemptions)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_counting_changes_no_decision(data):
    cfg = draw_config(data)
    cfg.update(enable_prefix_caching=data.draw(st.sampled_from([True, True, False])),
               uncache_unscheduled_victims=data.draw(st.booleans()))
    tracked = Scheduler(SchedulerConfig(**cfg))
    counting = Scheduler(SchedulerConfig(**cfg, track_block_ids=False))
    assert counting.kv_cache_manager.counting and not tracked.kv_cache_manager.counting
    # lead 0: a prompt all its own (unique_from 0), which keeps the pool counting
    reqs = draw_requests(data, cfg["max_model_len"], leads=[0, 0, 0, 20, 60])
    was_counting = [0]

    def after_step():
        was_counting[0] += counting.kv_cache_manager.counting
        counting.check_invariants()
    run_side_by_side((tracked, counting), reqs, lambda prompt, hint: ((prompt, hint), (prompt, hint)),
                     decisions, after_step)
    event(f"counted steps: {was_counting[0] > 0}; left counting: {not counting.kv_cache_manager.counting}; "
          f"preemptions: {tracked.num_preemptions > 0}; hits: {tracked.kv_cache_manager.num_hit_tokens > 0}")


def _request(rid: str, n: int, max_tokens: int, unique_from: int | None = 0) -> Request:
    r = Request(rid, [5] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    r.unique_from = unique_from
    return r


def _step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, dict.fromkeys(out.sampling_req_ids, [TOKEN]))
    return out


def test_counting_pool_holds_placeholders_and_counts():
    s = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=21, max_num_batched_tokens=64,
                                  max_model_len=40, track_block_ids=False))
    kvm = s.kv_cache_manager
    s.add_request(_request("a", 10, 3))
    s.add_request(_request("b", 5, 3))
    out = _step(s)
    # 10 prompt tokens -> 3 blocks of 4, 5 -> 2: 5 of the 20 usable, none with an identity.
    assert kvm.get_block_ids("a") == [-1, -1, -1] and kvm.get_block_ids("b") == [-1, -1]
    assert out.scheduled_new_reqs[0].block_ids == [-1, -1, -1]
    assert kvm.num_free_blocks == 15 and kvm.counting
    assert all(b is ANONYMOUS for b in kvm.req_to_blocks["a"])
    while s.has_unfinished_requests():
        _step(s)
    assert kvm.num_free_blocks == 20 and kvm.counting and not kvm.block_pool.cached
    s.check_invariants()


def test_shared_content_ends_counting_with_blocks_marked_as_tracked_ones_are():
    cfg = dict(block_size=4, num_gpu_blocks=41, max_num_batched_tokens=64, max_model_len=80)
    tracked = Scheduler(SchedulerConfig(**cfg))
    counting = Scheduler(SchedulerConfig(**cfg, track_block_ids=False))
    for s in (tracked, counting):
        s.add_request(_request("a", 10, 20))
        _step(s)
        _step(s)  # a: 11 computed, 12 tokens, 3 blocks held, the first 2 full and cached (UNIQUE)
    assert counting.kv_cache_manager.counting
    for s in (tracked, counting):
        s.add_request(_request("b", 9, 5, unique_from=None))  # may share content: hashing starts
        _step(s)
    kvm = counting.kv_cache_manager
    assert not kvm.counting
    marks = [b.block_hash is UNIQUE for b in kvm.req_to_blocks["a"]]
    assert marks == [b.block_hash is UNIQUE for b in tracked.kv_cache_manager.req_to_blocks["a"]]
    assert marks == [True, True, True]  # its decode this step filled block 3 (12 computed)
    # b: 9 prompt tokens in 3 blocks; all 6 held blocks have identities of their own now.
    assert len(set(kvm.get_block_ids("a") + kvm.get_block_ids("b"))) == 3 + 3
    assert -1 not in kvm.get_block_ids("a")
    assert kvm.num_free_blocks == tracked.kv_cache_manager.num_free_blocks == 40 - 6
    counting.check_invariants()


def test_preemption_ends_counting_and_the_victim_hits_its_own_blocks():
    # 8 usable blocks of 4 tokens; two requests of 12 prompt tokens growing to 28: the pool runs
    # out, the later one is preempted and, resuming, finds its prompt blocks still cached.
    cfg = dict(block_size=4, num_gpu_blocks=9, max_num_batched_tokens=64, max_model_len=40)
    results = []
    for track in (True, False):
        s = Scheduler(SchedulerConfig(**cfg, track_block_ids=track))
        s.add_request(_request("a", 12, 16))
        s.add_request(_request("b", 12, 16))
        while s.has_unfinished_requests():
            _step(s)
            s.check_invariants()
        assert s.num_preemptions > 0
        assert not s.kv_cache_manager.counting
        results.append((s.num_preemptions, s.kv_cache_manager.num_hit_tokens))
    assert results[0] == results[1] and results[0][1] > 0


@pytest.mark.parametrize("seed", range(0, 60, 2))
def test_counting_changes_no_simulated_record(seed, monkeypatch):
    base = random_scenario(seed)
    if seed % 4 == 0:  # content all unique: counting can last the whole run
        del base["workload"]["shared_prefix"]
    a, b = same_records_both_ways(base, monkeypatch, Replica, "track_block_ids")
    assert a.summary["requests"] == b.summary["requests"]


def test_counting_is_a_pool_class_not_branches():
    # Counting is the CountingBlockPool strategy: no `if`/conditional in the KV manager or the block
    # pool asks whether the pool counts.
    import ast
    from pathlib import Path
    core = Path(__file__).resolve().parents[1] / "engine" / "core"
    for name in ("kv_cache_manager.py", "block_pool.py"):
        tree = ast.parse((core / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
                names = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
                names |= {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
                assert "counting" not in names, f"{name}:{node.lineno}: a branch on counting mode"
    from engine.core.block_pool import BlockPool, CountingBlockPool
    kvm = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=9, max_num_batched_tokens=64,
                                    max_num_seqs=4, max_model_len=32, track_block_ids=False)).kv_cache_manager
    assert type(kvm.block_pool) is CountingBlockPool and kvm.counting
    assert type(Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=9, max_num_batched_tokens=64,
                                          max_num_seqs=4, max_model_len=32)).kv_cache_manager.block_pool) is BlockPool
