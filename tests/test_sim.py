"""Simulator: metrics on hand-built timelines, queueing laws, determinism, exact fast paths."""
import math

import numpy as np
import pytest

from engine.core import SchedulerConfig
from engine.core.records import RequestRecord
from sim.cost_model import AnalyticCostModel, FittedCostModel
from sim.metrics import itl_from_token_times, requests_frame, stats, summarize, weighted_percentiles
from sim.simulation import Simulation
from sim.workload import RequestSpec, Workload, build_workload
from tests.test_sim_fuzz import assert_step_tables_agree


def fixed_cost(intercept: float, per_token: float = 0.0) -> FittedCostModel:
    return FittedCostModel(intercept_s=intercept, per_token_s=per_token)


def sim_run(workload, cfg=None, cost=None, **kw):
    cfg = cfg or SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096,
                                 block_size=16, num_gpu_blocks=4000)
    return Simulation(workload, cfg, cost or fixed_cost(0.01, 1e-5), **kw).run()


# ----------------------------------------------------------------- metrics
def test_hand_built_timeline_metrics():
    # queue 300 ms, prefill 120 ms, 200 tokens 25 ms apart.
    times = [0.42 + 0.025 * i for i in range(200)]
    rec = RequestRecord("a", arrival_s=0.0, num_prompt_tokens=100, first_scheduled_s=0.3,
                        first_token_s=times[0], last_token_s=times[-1], finish_s=times[-1],
                        num_output_tokens=200, finish_reason="length", token_times_s=times)
    df = requests_frame([rec])
    itl, w = itl_from_token_times([rec])
    s = summarize(df, itl, w)
    assert s["ttft_s"]["mean"] == pytest.approx(0.420)
    assert s["tpot_s"]["mean"] == pytest.approx(0.025)
    assert s["e2e_s"]["mean"] == pytest.approx(5.395)
    assert s["queue_s"]["mean"] == pytest.approx(0.300)
    assert s["itl_s"]["count"] == 199 and s["itl_s"]["p99"] == pytest.approx(0.025)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(200 / 5.395)


def test_simulated_timeline_matches_hand_calculation():
    # Step time = 0.0249 + 0.0001 * tokens: a 951-token prefill takes 120 ms, a decode 25 ms.
    spec = RequestSpec("a", 0.0, 951, 200, ((10, 951),))
    res = sim_run(Workload.from_requests([spec]), cost=fixed_cost(0.0249, 0.0001), keep_token_times=True)
    s = res.summary
    assert s["ttft_s"]["mean"] == pytest.approx(0.120)
    assert s["tpot_s"]["mean"] == pytest.approx(0.025)
    assert s["e2e_s"]["mean"] == pytest.approx(0.120 + 199 * 0.025)
    assert s["itl_s"]["count"] == 199 and s["itl_s"]["p50"] == pytest.approx(0.025)


def test_weighted_percentiles_equal_expanded_sample():
    rng = np.random.default_rng(1)
    v = rng.random(50)
    w = rng.integers(1, 6, 50)
    expanded = np.repeat(v, w)
    assert weighted_percentiles(v, w) == pytest.approx(list(np.percentile(expanded, [50, 90, 95, 99])))
    assert stats(v, w)["mean"] == pytest.approx(expanded.mean())


# ----------------------------------------------------------------- queueing
def test_md1_queue_matches_pollaczek_khinchine():
    # One request at a time (max_num_seqs=1), each served by exactly one step of D seconds
    # (prefill, sampling its only token): an M/D/1 queue. Wq = rho * D / (2 (1 - rho)).
    D, lam, n = 0.1, 5.0, 20000
    rho = lam * D
    wl = build_workload({"num_requests": n, "arrival": {"type": "poisson", "rate": lam},
                         "prompt_len": {"type": "fixed", "value": 32},
                         "output_len": {"type": "fixed", "value": 1},
                         "client": {"type": "engine_direct"}}, seed=3)  # the engine's own queue
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=128,
                          block_size=16, num_gpu_blocks=20)
    res = sim_run(wl, cfg, fixed_cost(D))
    wq = res.requests["queue_s"].mean()
    expected = rho * D / (2 * (1 - rho))
    assert wq == pytest.approx(expected, rel=0.06)
    assert res.requests["e2e_s"].mean() == pytest.approx(expected + D, rel=0.04)


def test_littles_law_on_long_poisson_run():
    lam = 20.0
    wl = build_workload({"num_requests": 6000, "arrival": {"type": "poisson", "rate": lam},
                         "prompt_len": {"type": "uniform", "min": 50, "max": 400},
                         "output_len": {"type": "uniform", "min": 10, "max": 200}}, seed=5)
    cost = AnalyticCostModel("llama-3.1-8b", "h100-sxm")
    res = sim_run(wl, cost=cost)
    df, steps = res.requests, res.steps
    # L measured from the replica's own state over time (time-weighted running + waiting).
    dur = steps["end_s"] - steps["start_s"]
    busy_L = float(((steps["num_running"] + steps["num_waiting"]) * dur).sum())
    T = df["finish_s"].max() - df["arrival_s"].min()
    L = busy_L / T
    lam_hat = len(df) / T
    W = df["e2e_s"].mean()
    assert L == pytest.approx(lam_hat * W, rel=0.05)


# ----------------------------------------------------------- determinism
def _wl(seed, **extra):
    spec = {"num_requests": 400, "arrival": {"type": "gamma", "rate": 30, "burstiness": 0.5},
            "prompt_len": {"type": "lognormal", "mean": 600, "sigma": 0.9, "min": 8, "max": 3000},
            "output_len": {"type": "lognormal", "mean": 120, "sigma": 0.8, "min": 1, "max": 800},
            "shared_prefix": {"num_prefixes": 3, "length": 256, "fraction": 0.7}}
    spec.update(extra)
    return build_workload(spec, seed=seed)


def test_same_seed_same_results():
    a = sim_run(_wl(7))
    b = sim_run(_wl(7))
    c = sim_run(_wl(8))
    assert a.requests.equals(b.requests)
    assert a.summary["ttft_s"] == b.summary["ttft_s"]
    assert not a.requests["finish_s"].equals(c.requests["finish_s"])


# ------------------------------------------- steady decoding is exact
TIMESTAMPS = ["arrival_s", "first_scheduled_s", "first_token_s", "last_token_s", "finish_s",
              "num_output_tokens", "num_cached_tokens", "num_preemptions", "finish_reason", "replica"]


@pytest.mark.parametrize("case", ["plain", "preempting", "cancellation", "replicas", "closed_loop",
                                  "closed_loop_cancellation"])
def test_steady_decoding_gives_identical_timestamps(case):
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64, max_model_len=4096,
                          block_size=16, num_gpu_blocks=4000)
    kw = {}
    extra = {}
    if case == "preempting":
        cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=4096,
                              block_size=16, num_gpu_blocks=260)
    if case == "cancellation":
        extra = {"cancellation": {"deadline_s": 4.0, "fraction": 0.3, "at_output_fraction": 0.4}}
    if case == "replicas":
        kw = {"num_replicas": 3, "router": "least_outstanding"}
    if case.startswith("closed_loop"):
        extra = {"arrival": {"type": "concurrency", "concurrency": 24}}
    if case == "closed_loop_cancellation":
        extra["cancellation"] = {"deadline_s": 3.0, "fraction": 0.3, "at_output_fraction": 0.4}
    cost = AnalyticCostModel("llama-3.1-8b", "h100-sxm")
    slow = sim_run(_wl(11, **extra), cfg, cost, use_steady=False, keep_token_times=True, **kw)
    fast = sim_run(_wl(11, **extra), cfg, cost, use_steady=True, keep_token_times=True, **kw)
    assert slow.requests[TIMESTAMPS].equals(fast.requests[TIMESTAMPS])
    assert [r.token_times_s for r in slow.records] == [r.token_times_s for r in fast.records]
    # The ITL sample is the same multiset of gaps.
    for res in (slow, fast):
        v, w = res.itl
        res.itl_sorted = np.repeat(v, w)
        res.itl_sorted.sort()
    assert np.array_equal(slow.itl_sorted, fast.itl_sorted)
    assert fast.summary["num_steps"] == slow.summary["num_steps"]
    assert len(fast.steps) < len(slow.steps)  # steady runs actually happened
    assert_step_tables_agree(fast.step_table, slow.step_table)
    if case == "preempting":
        assert slow.summary["requests"]["preemptions"] > 0
    if case == "cancellation":
        assert slow.summary["requests"]["aborted"] > 0


def test_cancellations_free_blocks():
    wl = _wl(2, cancellation={"deadline_s": 1.0, "fraction": 0.5, "at_output_fraction": 0.3})
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=4096,
                          block_size=16, num_gpu_blocks=3000)
    sim = Simulation(wl, cfg, AnalyticCostModel("llama-3.1-8b", "h100-sxm"))
    res = sim.run()
    df = res.requests
    aborted = df[df["finish_reason"] == "abort"]
    assert len(aborted) > 50
    # Aborted requests got fewer tokens than asked for, and never after their abort time.
    specs = {s.request_id: s for s in wl}
    assert all(row.num_output_tokens < specs[row.request_id].output_len for row in aborted.itertuples())
    assert (aborted["last_token_s"].fillna(-1) <= aborted["finish_s"]).all()
    kvm = sim.replicas[0].scheduler.kv_cache_manager
    assert kvm.num_free_blocks == kvm.num_usable_blocks
    assert not sim.replicas[0].scheduler.has_unfinished_requests()


def test_rejected_requests_are_recorded_not_fatal():
    specs = [RequestSpec("ok", 0.0, 100, 10, ((0, 100),)), RequestSpec("huge", 0.1, 5000, 10, ((1000, 5000),)),
             RequestSpec("ok2", 0.2, 100, 10, ((9000, 100),))]
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=2048,
                          block_size=16, num_gpu_blocks=400)
    res = sim_run(Workload.from_requests(specs), cfg)
    reasons = dict(zip(res.requests["request_id"], res.requests["finish_reason"]))
    assert reasons == {"ok": "length", "huge": "rejected", "ok2": "length"}
    assert res.summary["requests"]["rejected"] == 1


def test_kv_capacity_limits_batch_and_preempts():
    wl = build_workload({"num_requests": 200, "arrival": {"type": "poisson", "rate": 200},
                         "prompt_len": {"type": "fixed", "value": 500},
                         "output_len": {"type": "fixed", "value": 300}}, seed=1)
    small = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=4096,
                            block_size=16, num_gpu_blocks=400)  # ~8 requests of 800 tokens
    res = sim_run(wl, small, AnalyticCostModel("llama-3.1-8b", "h100-sxm"))
    assert res.steps["num_running"].max() <= 400 * 16 // 500
    assert res.steps["kv_usage"].max() > 0.9
    assert res.summary["requests"]["completed"] == 200
    assert math.isfinite(res.summary["e2e_s"]["p99"])


def test_truncated_run_counts_throughput_over_the_cut():
    # One long request and one short: cut at 2 s, the long one is unfinished with its tokens
    # so far; throughput divides by the 2 s simulated, not by the short request's lifetime.
    specs = [RequestSpec("long", 0.0, 10, 1000, ((0, 10),)), RequestSpec("short", 0.0, 10, 50, ((100, 10),))]
    for steady in (True, False):
        res = sim_run(Workload.from_requests(specs), cost=fixed_cost(0.01), max_time_s=2.0, use_steady=steady)
        s = res.summary
        assert s["requests"]["completed"] == 1 and s["requests"]["unfinished"] == 1
        assert s["duration_s"] == pytest.approx(2.0)
        tokens = int(res.requests["num_output_tokens"].sum())
        assert 240 <= tokens <= 250  # ~199 + 50 steps of 10 ms
        assert s["throughput"]["output_tokens_per_s"] == pytest.approx(tokens / 2.0)


def test_abort_asked_twice_at_one_boundary():
    # Steps of 10 ms: request a's 10th token ends step 10 at 0.10 s, when its client hangs up;
    # its 0.095 s deadline passed during that step: both ask to abort it at the same boundary.
    spec = RequestSpec("a", 0.0, 50, 500, ((0, 50),), cancel_after_s=0.095, cancel_after_tokens=10)
    other = RequestSpec("b", 0.0, 50, 20, ((100, 50),))
    for steady in (True, False):
        sim = Simulation(Workload.from_requests([spec, other]), SchedulerConfig(
            max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024, block_size=16,
            num_gpu_blocks=200), fixed_cost(0.01), use_steady=steady)
        res = sim.run()
        df = res.requests.set_index("request_id")
        assert df.loc["a", "finish_reason"] == "abort" and df.loc["b", "finish_reason"] == "length"
        assert df.loc["a", "num_output_tokens"] == 10
        assert df.loc["a", "finish_s"] == pytest.approx(0.10)
        kvm = sim.replicas[0].scheduler.kv_cache_manager
        assert kvm.num_free_blocks == kvm.num_usable_blocks


def test_truncated_requests_keep_requested_and_generated_lengths():
    # max_model_len 256: a 200-token prompt asking for 100 tokens gets 56 (the engine core's rule,
    # engine.core.admission), finishes with "length", and is counted as truncated.
    specs = [RequestSpec("fits", 0.0, 100, 50, ((0, 100),)), RequestSpec("cut", 0.0, 200, 100, ((1000, 200),))]
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=256,
                          block_size=16, num_gpu_blocks=400)
    for steady in (False, True):
        res = sim_run(Workload.from_requests(specs), cfg, use_steady=steady)
        t = res.requests
        rows = {rid: (req, out, fr) for rid, req, out, fr in zip(
            t["request_id"], t["num_requested_output_tokens"], t["num_output_tokens"], t["finish_reason"])}
        assert rows == {"fits": (50, 50, "length"), "cut": (100, 56, "length")}
        assert res.summary["requests"]["truncated"] == 1 and res.summary["requests"]["completed"] == 2


def test_book_itl_sample_equals_gaps_of_token_times():
    # The replica's compressed ITL (per-step continuation counts + explicit gaps) against the
    # plain definition: every gap between consecutive token times of every request.
    wl = build_workload({"num_requests": 120, "arrival": {"type": "poisson", "rate": 40},
                         "prompt_len": {"type": "uniform", "min": 16, "max": 900},
                         "output_len": {"type": "uniform", "min": 1, "max": 200}}, seed=3)
    small = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=4096,
                            block_size=16, num_gpu_blocks=300)  # preemptions: gaps across steps
    for steady in (False, True):
        sim = Simulation(wl, small, fixed_cost(0.01, 1e-5), keep_token_times=True, use_steady=steady)
        res = sim.run()
        assert res.summary["requests"]["preemptions"] > 0
        v, w = sim.replicas[0].itl_sample()
        expanded = np.sort(np.repeat(v, w))
        gaps, _ = itl_from_token_times(sim.records)
        np.testing.assert_allclose(expanded, np.sort(gaps), rtol=0, atol=1e-12)


@pytest.mark.parametrize("client", [None, {"type": "engine_direct"}, {"tokenize_s_per_token": 1e-4}])
@pytest.mark.parametrize("async_admission", [False, True])
def test_direct_feed_equals_arrivals_through_the_client(async_admission, client):
    """An open loop on one replica takes its requests straight from the workload (Simulation.direct_feed)
    and its fast runs go on through arrivals; the records, token times and step table equal those
    of the same simulation with every arrival sent through the client as a SimPy event: with the
    default request path, with none, and with a tokenizer slow enough to queue requests (30 per
    second of about 600 tokens at 100 us a token: more work than the run has seconds)."""
    from sim.cpu_work import WithCpuWork
    from sim.kernel_model import KernelCostModel
    cost = (WithCpuWork(KernelCostModel("llama-3.1-8b", "h100-sxm"), async_scheduling=True) if async_admission
            else AnalyticCostModel("llama-3.1-8b", "h100-sxm"))
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=4096,
                          block_size=16, num_gpu_blocks=700)
    extra = {} if client is None else {"client": client}
    runs = {}
    for feed in (True, False):
        sim = Simulation(_wl(5, **extra), cfg, cost, keep_token_times=True)
        assert sim.direct_feed and sim.replicas[0].async_admission == async_admission
        sim.direct_feed = feed
        runs[feed] = sim.run()
    fed, sent = runs[True], runs[False]
    assert fed.requests[TIMESTAMPS].equals(sent.requests[TIMESTAMPS])
    assert [r.token_times_s for r in fed.records] == [r.token_times_s for r in sent.records]
    assert fed.summary["num_steps"] == sent.summary["num_steps"]
    assert len(fed.steps) < len(sent.steps)  # runs went on through arrivals
    assert sent.summary["requests"]["preemptions"] > 0  # the pool is tight enough to preempt
    # A fast row sums the rows of the steps it covers; compare both with plain steps.
    plain = Simulation(_wl(5, **extra), cfg, cost, use_steady=False).run()
    assert_step_tables_agree(fed.step_table, plain.step_table)
    if client and client.get("tokenize_s_per_token"):  # the API server's tokenizer was a queue
        assert fed.summary["client"]["tokenizer_busy_fraction"] > 0.6


def test_direct_feed_only_where_every_arrival_is_known_ahead():
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64, max_model_len=4096,
                          block_size=16, num_gpu_blocks=4000)
    cost = fixed_cost(0.01)
    assert Simulation(_wl(1), cfg, cost).direct_feed
    assert not Simulation(_wl(1), cfg, cost, use_steady=False).direct_feed
    assert not Simulation(_wl(1), cfg, cost, num_replicas=2).direct_feed
    assert not Simulation(_wl(1, arrival={"type": "concurrency", "concurrency": 8}), cfg, cost).direct_feed
    cancel = {"deadline_s": 4.0, "fraction": 0.3, "at_output_fraction": 0.4}
    assert not Simulation(_wl(1, cancellation=cancel), cfg, cost).direct_feed


def test_clock_timeout_at_lands_on_the_exact_float():
    # An event at an absolute time: also where no delay d has now + d == at (a rounding tie).
    import random as _random

    from sim.simulation import Clock
    rng = _random.Random(7)
    for _ in range(300):
        env = Clock()
        now = rng.random() * 10 ** rng.randint(-6, 3)
        env.run(until=env.timeout(now))
        at = now
        for _ in range(rng.randint(1, 400)):
            at += rng.random() * 0.05
        got = []
        ev = env.timeout_at(at)
        ev.callbacks.append(lambda _e: got.append(env.now))
        env.run()
        assert got == [at]
    env = Clock()
    env.run(until=env.timeout(0.41760860720539056))  # no float delay reaches this `at` from here
    got = []
    ev = env.timeout_at(0.9754534991362968)
    ev.callbacks.append(lambda _e: got.append(env.now))
    env.run()
    assert got == [0.9754534991362968]
    with pytest.raises(ValueError, match="before the clock"):
        env.timeout_at(0.5)
