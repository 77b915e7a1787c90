"""Scheduler behaviour against hand calculations and vLLM's own CPU test vectors."""
import pytest

from engine.core import (BlockPool, Request, RequestStatus, SamplingParams, Scheduler,
                         SchedulerConfig, ShortestPromptFirstQueue, WaitingQueue, batch_features,
                         register_policy)
from tests.helpers import make_request, make_scheduler, step


# ----------------------------------------------------------------- vLLM test vectors
def test_concurrent_partial_prefill_vector():
    s = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 800))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 400, "r1": 400, "r2": 224}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 400, "r1": 400, "r2": 224}
    out, outs = step(s)
    # r0 and r1 finished their prompts in step 2 and sampled; r2 has 352 left.
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 352}


def test_lone_request_ignores_long_prefill_threshold():
    s = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    s.add_request(make_request("a", 800))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 800}


def test_stop_on_eos():
    s = make_scheduler()
    s.add_request(make_request("a", 10, max_tokens=10, eos=2))
    step(s, token=5)
    _, outs = step(s, token=2)
    assert outs[0].finish_reason == "stop" and outs[0].new_token_ids == [2]
    assert "a" not in s.requests and not s.has_unfinished_requests()


def test_stop_token_id_trims_and_sets_stop_reason():
    s = make_scheduler()
    s.add_request(make_request("a", 10, max_tokens=10, stop_token_ids=[42]))
    out = s.schedule()
    outs = s.update_from_output(out, {"a": [5, 42, 9]})  # several tokens: trimmed after 42
    assert outs[0].new_token_ids == [5, 42]
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 42


def test_max_tokens_trims():
    s = make_scheduler()
    s.add_request(make_request("a", 10, max_tokens=2))
    out = s.schedule()
    outs = s.update_from_output(out, {"a": [5, 6, 7]})
    assert outs[0].new_token_ids == [5, 6] and outs[0].finish_reason == "length"


def test_ignore_eos_keeps_going():
    s = make_scheduler()
    s.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=3, ignore_eos=True),
                          eos_token_id=2))
    reasons = [step(s, token=2)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, "length"]


def test_min_tokens_defers_eos():
    s = make_scheduler()
    s.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=10, min_tokens=3),
                          eos_token_id=2))
    reasons = [step(s, token=2)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, "stop"]


def test_max_model_len_caps_length():
    s = make_scheduler(max_model_len=20)
    s.add_request(make_request("a", 18, max_tokens=100))
    outs = [step(s)[1] for _ in range(2)]
    assert outs[-1][0].finish_reason == "length"
    assert not s.has_unfinished_requests()


def test_preemption_vector_and_resume():
    # 11 blocks of 16 (10 usable), two 80-token prompts: 5 blocks each fill the pool.
    s = make_scheduler(num_gpu_blocks=11, max_model_len=160)
    s.add_request(make_request("a", 80, max_tokens=20))
    s.add_request(make_request("b", 80, max_tokens=20))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 80, "b": 80}
    assert s.kv_cache_manager.num_free_blocks == 0
    # Token 81 of "a" needs a 6th block: "b" (the last admitted) is preempted, nothing admitted.
    out, _ = step(s)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 1  # its first output survives preemption
    finished = {}
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        _, outs = step(s)
        for o in outs:
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
        s.check_invariants()
    assert finished == {"a": "length", "b": "length"}
    assert s.kv_cache_manager.num_free_blocks == 10
    assert s.num_preemptions >= 1


def test_resumed_request_hits_its_own_cached_blocks():
    s = make_scheduler(num_gpu_blocks=11, max_model_len=160)
    s.add_request(make_request("a", 80, max_tokens=3))
    s.add_request(make_request("b", 80, max_tokens=3))
    step(s)
    out, _ = step(s)
    assert out.preempted_req_ids == {"b"}
    while "a" in s.requests:
        step(s)
    out, _ = step(s)
    # b's prompt blocks were freed with their hashes and not all reused: the resume hits them.
    (resumed,) = out.scheduled_resumed_reqs
    assert resumed.req_id == "b" and resumed.num_computed_tokens >= 64
    assert resumed.output_token_ids == [7]
    assert out.num_scheduled_tokens["b"] == 81 - resumed.num_computed_tokens


def test_abort_frees_blocks_and_others_continue():
    s = make_scheduler(num_gpu_blocks=50)
    s.add_request(make_request("a", 40, max_tokens=10))
    s.add_request(make_request("b", 40, max_tokens=10))
    step(s)
    step(s)
    held_b = len(s.kv_cache_manager.get_block_ids("b"))
    free_before = s.kv_cache_manager.num_free_blocks
    s.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    assert s.kv_cache_manager.num_free_blocks == free_before + held_b
    out, _ = step(s)
    assert out.finished_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    s.check_invariants()


def test_abort_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    step(s)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert "b" not in s.requests and len(s.waiting) == 0
    s.check_invariants()


def test_budget_and_max_num_seqs():
    s = make_scheduler(max_num_batched_tokens=100, max_num_seqs=3)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 60))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 60, "r1": 40}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 20, "r2": 60}  # 3 running: r3 must wait
    assert len(s.running) == 3


def test_chunked_prefill_off_waits_for_budget():
    s = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=64)
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 40))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 40}  # b does not fit in the 24 left and cannot chunk


def test_reserve_full_prompt_switch():
    # 7 usable blocks of 16; "a" holds 2; "b" has a 96-token prompt (6 blocks), budget 32.
    def run(reserve):
        s = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=32, reserve_full_prompt=reserve,
                           max_model_len=200)
        s.add_request(make_request("a", 20, max_tokens=5))
        step(s)
        s.add_request(make_request("b", 96, max_tokens=5))
        out, _ = step(s)
        return out.num_scheduled_tokens
    assert run(True) == {"a": 1}                  # whole prompt must fit: not admitted
    assert run(False) == {"a": 1, "b": 31}        # older V1: the first chunk is enough


def test_priority_policy_order_and_victim():
    s = make_scheduler(policy="priority", num_gpu_blocks=11, max_model_len=160)
    s.add_request(make_request("low", 80, max_tokens=20, priority=5, arrival=0.0))
    s.add_request(make_request("high", 80, max_tokens=20, priority=0, arrival=1.0))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["high", "low"]  # admitted by priority
    out, _ = step(s)
    # "high" needs a block; the victim is the worst (priority, arrival): "low".
    assert out.preempted_req_ids == {"low"} and out.num_scheduled_tokens == {"high": 1}


def test_priority_victim_already_scheduled_is_refunded():
    # 4 usable blocks: y (priority 0, 31 tokens) and x (priority 9, 17 tokens) hold 2 each.
    s = make_scheduler(policy="priority", num_gpu_blocks=5, max_model_len=64, block_size=16)
    s.add_request(make_request("y", 31, max_tokens=30, priority=0, arrival=1.0))
    s.add_request(make_request("x", 17, max_tokens=30, priority=9, arrival=0.0))
    step(s)
    assert s.kv_cache_manager.num_free_blocks == 0
    s.running.reverse()  # x first in the running list, so it is scheduled before y asks
    out, _ = step(s)     # x -> 18 tokens, y -> 32 tokens: both still fit in 2 blocks
    assert out.num_scheduled_tokens == {"x": 1, "y": 1}
    out, _ = step(s)     # y's token 33 needs a 3rd block: x was scheduled, is un-scheduled
    assert out.preempted_req_ids == {"x"}
    assert out.num_scheduled_tokens == {"y": 1} and out.total_num_scheduled_tokens == 1
    assert out.scheduled_cached_reqs.req_ids == ["y"]
    s.check_invariants()


def test_custom_policy_is_a_small_class():
    s = make_scheduler(policy=ShortestPromptFirstQueue, max_num_seqs=1)
    s.add_request(make_request("long", 50, arrival=0.0))
    s.add_request(make_request("short", 5, arrival=1.0))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["short"]

    class LongestFirst(ShortestPromptFirstQueue):
        @staticmethod
        def key(r):
            return (-r.num_prompt_tokens, r.arrival_time)

    register_policy("longest_first", LongestFirst)
    s = make_scheduler(policy="longest_first", max_num_seqs=1)
    s.add_request(make_request("short", 5))
    s.add_request(make_request("long", 50))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["long"]
    assert issubclass(LongestFirst, WaitingQueue)


# ------------------------------------------------------------------- prefix caching
def test_prefix_cache_hit_shares_blocks():
    s = make_scheduler(num_gpu_blocks=100)
    prefix = list(range(100, 164))  # 4 full blocks
    s.add_request(make_request("a", tokens=prefix + [1, 2, 3], max_tokens=4))
    step(s)
    s.add_request(make_request("b", tokens=prefix + [9, 9], max_tokens=4))
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 64
    assert out.num_scheduled_tokens["b"] == 2
    ids_a, ids_b = s.kv_cache_manager.get_block_ids("a"), s.kv_cache_manager.get_block_ids("b")
    assert ids_a[:4] == ids_b[:4] and ids_a[4] != ids_b[4]
    for bid in ids_a[:4]:
        assert s.kv_cache_manager.block_pool.blocks[bid].ref_cnt == 2
    s.check_invariants()


def test_last_token_always_recomputed():
    s = make_scheduler(num_gpu_blocks=100)
    toks = list(range(200, 232))  # exactly 2 blocks
    s.add_request(make_request("a", tokens=toks, max_tokens=1))
    step(s)
    s.add_request(make_request("b", tokens=toks, max_tokens=1))
    out, _ = step(s)
    # Only (32 - 1) // 16 = 1 block may hit: the final token must produce logits.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"b": 16}


def test_prefix_caching_off_no_hits():
    s = make_scheduler(enable_prefix_caching=False)
    toks = list(range(64))
    s.add_request(make_request("a", tokens=toks + [1], max_tokens=1))
    step(s)
    s.add_request(make_request("b", tokens=toks + [2], max_tokens=1))
    out, _ = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_cache_salt_separates_prefixes():
    s = make_scheduler()
    toks = list(range(64)) + [1]
    s.add_request(Request("a", toks, SamplingParams(max_tokens=1), cache_salt="tenant-1"))
    step(s)
    s.add_request(Request("b", toks, SamplingParams(max_tokens=1), cache_salt="tenant-2"))
    s.add_request(Request("c", toks, SamplingParams(max_tokens=1), cache_salt="tenant-1"))
    out, _ = step(s)
    hits = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
    assert hits == {"b": 0, "c": 64}


# ---------------------------------------------------------------------- block pool
def test_block_pool_null_block_and_lru_eviction():
    pool = BlockPool(5, enable_caching=True)
    assert pool.get_num_free_blocks() == 4 and pool.null_block.block_id == 0
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2]
    pool.cache_block(a[0], 111)
    pool.free_blocks(reversed(a))  # 0.33: unhashed block 2 to the head, hashed block 1 to the tail
    assert [b.block_id for b in pool.free_queue] == [2, 3, 4, 1]
    assert pool.get_cached_block(111) is a[0]
    got = pool.get_new_blocks(4)  # finally reuses block 1: its hash is evicted lazily
    assert [b.block_id for b in got] == [2, 3, 4, 1]
    assert pool.get_cached_block(111) is None and got[-1].block_hash is None


def test_block_pool_old_free_order():
    pool = BlockPool(5, enable_caching=True, unhashed_first=False)
    a = pool.get_new_blocks(2)
    pool.cache_block(a[0], 111)
    pool.free_blocks(reversed(a))
    assert [b.block_id for b in pool.free_queue] == [3, 4, 2, 1]


def test_touch_takes_cached_block_out_of_free_queue():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 5)
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert b not in list(pool.free_queue)


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize("field,value", [
    ("max_num_batched_tokens", 0), ("max_num_seqs", -1), ("max_model_len", 0),
    ("block_size", 0), ("num_gpu_blocks", 1), ("num_gpu_blocks", -5),
    ("long_prefill_token_threshold", -1), ("policy", "nope"), ("watermark", 1.5),
])
def test_bad_config_names_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        make_scheduler(**{field: value})
    assert field in str(e.value) and repr(value) in str(e.value)


def test_budget_below_block_size_without_chunking():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8.*block_size=16"):
        make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=True)  # fine with chunking
    # Without chunking every sequence must fit in one step (vLLM's rule), else it waits for ever.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=64.*max_model_len=100"):
        make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=100)


def test_fit_check_counts_only_computed_tokens():
    # 15 prompt tokens + 2 outputs: the last sampled token is never computed, so 16 slots = 1 block.
    s = make_scheduler(num_gpu_blocks=2, block_size=16, max_model_len=64)
    s.add_request(make_request("a", 15, max_tokens=2))
    for _ in range(3):
        step(s)
    assert not s.has_unfinished_requests()
    with pytest.raises(ValueError, match="needs 2 KV blocks"):
        s.add_request(make_request("b", 15, max_tokens=3))


@pytest.mark.parametrize("budget,thr", [(200, 0), (32, 0), (200, 24)])
def test_prompt_of_exactly_max_model_len_gets_one_token(budget, thr):
    # Accepted (only a longer prompt is refused); scheduled whole or in chunks, it computes its
    # prompt, samples one token and is length-capped.
    s = make_scheduler(max_model_len=100, num_gpu_blocks=20, max_num_batched_tokens=budget,
                       long_prefill_token_threshold=thr)
    s.add_request(make_request("exact", 100, max_tokens=None))
    s.add_request(make_request("other", 10, max_tokens=3))
    outs = {}
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        for o in step(s)[1]:
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                assert o.finish_reason == "length"
    assert not s.has_unfinished_requests()
    assert len(outs["exact"]) == 1 and len(outs["other"]) == 3
