"""Random scenarios: the steady fast path and plain steps give identical per-request records and
step tables (a fast row is the sum of the plain rows of the steps it covers)."""
import random

import numpy as np
import pytest

from engine.core.records import STEP_COLUMNS

from sim.scenario import parse_scenario, run_scenario

COLUMNS = ["arrival_s", "first_scheduled_s", "first_token_s", "last_token_s", "finish_s",
           "num_output_tokens", "num_cached_tokens", "num_preemptions", "finish_reason", "replica"]


def random_scenario(seed: int) -> dict:
    rng = random.Random(seed)
    closed = rng.random() < 0.25
    arrival = ({"type": "concurrency", "concurrency": rng.choice([4, 32])} if closed else
               {"type": rng.choice(["poisson", "gamma", "constant"]), "rate": rng.choice([5, 20, 80])})
    if arrival["type"] == "gamma":
        arrival["burstiness"] = rng.choice([0.3, 1.0, 3.0])
    workload = {"num_requests": rng.choice([50, 150]), "arrival": arrival,
                "prompt_len": {"type": "lognormal", "mean": 600, "sigma": 1.0, "min": 4, "max": 3500},
                "output_len": {"type": "lognormal", "mean": 150, "sigma": 1.0, "min": 1, "max": 500},
                "shared_prefix": {"num_prefixes": 3, "length": 200, "fraction": 0.5},
                "priority": {"type": "uniform_int", "min": 0, "max": 3}}
    if rng.random() < 0.5:
        workload["cancellation"] = {"deadline_s": rng.choice([2, 10]), "fraction": 0.2, "at_output_fraction": 0.5}
    return {"name": "fuzz", "seed": seed,
            "deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "replicas": 1 if closed else rng.choice([1, 2, 3]),
                           "router": rng.choice(["round_robin", "least_outstanding", "prefix_affinity", "random"]),
                           "num_gpu_blocks": rng.choice([300, 800, 5000])},
            "scheduler": {"max_num_batched_tokens": rng.choice([256, 1024, 8192]), "max_num_seqs": rng.choice([4, 32, 256]),
                          "max_model_len": 4096, "policy": rng.choice(["fcfs", "priority", "shortest_prompt_first"]),
                          "enable_prefix_caching": rng.random() < 0.8,
                          "long_prefill_token_threshold": rng.choice([0, 0, 256]),
                          "reserve_full_prompt": rng.random() < 0.7},
            "workload": workload}


@pytest.mark.parametrize("seed", range(60))
def test_steady_equals_plain_on_random_scenarios(seed):
    base = random_scenario(seed)
    results = {}
    for steady in (True, False):
        results[steady] = run_scenario(parse_scenario({**base, "simulation": {"steady_decode": steady}}))
    fast, slow = results[True], results[False]
    assert fast.requests[COLUMNS].equals(slow.requests[COLUMNS])
    assert_step_tables_agree(fast.step_table, slow.step_table)
    assert fast.summary["num_steps"] == slow.summary["num_steps"]
    for r in fast.summary, slow.summary:
        assert r["requests"]["total"] == base["workload"]["num_requests"]
        assert r["requests"]["unfinished"] == 0


SUMMED = ["num_reqs", "num_prefill_reqs", "num_prefill_tokens", "prefill_context_tokens",
          "prefill_attn_pairs", "num_decode_reqs", "decode_context_tokens", "num_tokens", "num_preempted"]
AFTER_LAST = ["num_running", "num_waiting", "kv_usage"]


def assert_step_tables_agree(fast: dict, plain: dict) -> None:
    """Each fast row (steps [step, step + num_steps) of one replica) equals the plain rows of those
    steps: features summed, start of the first, end, running, waiting and KV usage of the last."""
    assert set(fast) == set(plain) == set(STEP_COLUMNS)
    assert (plain["num_steps"] == 1).all()
    assert int(fast["num_steps"].sum()) == len(plain["step"])
    for rep in np.unique(plain["replica"]):
        p = {c: v[plain["replica"] == rep] for c, v in plain.items()}
        f = {c: v[fast["replica"] == rep] for c, v in fast.items()}
        assert (p["step"] == np.arange(len(p["step"]))).all()
        first = f["step"]
        last = first + f["num_steps"] - 1
        assert (first[1:] == last[:-1] + 1).all() and first[0] == 0 and last[-1] == len(p["step"]) - 1
        for c in SUMMED:
            sums = np.add.reduceat(p[c], first)
            assert np.array_equal(sums, f[c]), f"replica {rep}: column {c} differs"
        assert np.array_equal(f["start_s"], p["start_s"][first])
        assert np.array_equal(f["end_s"], p["end_s"][last])
        for c in AFTER_LAST:
            assert np.array_equal(f[c], p[c][last]), f"replica {rep}: column {c} differs"
        assert np.allclose(np.add.reduceat(p["forward_s"], first), f["forward_s"], rtol=1e-9, atol=1e-12)
    # Totals, the check: sum of each feature over the whole run.
    for c in SUMMED:
        assert fast[c].sum() == plain[c].sum()


@pytest.mark.parametrize("seed", [s for s in range(40) if random_scenario(s)["workload"]["arrival"]["type"] != "concurrency"][:12])
def test_steady_equals_plain_with_an_http_client(seed):
    """Open loops through an HTTP client (API-server time, its tokenizer and per-token output
    time; an open loop's sends have no turnaround and wait for no response): fast runs go on
    through finishes (Simulation.quiet_finishes) and, on one replica, through arrivals (the direct
    feed), and change no record and no step row."""
    base = random_scenario(seed)
    base["workload"]["client"] = {"type": "http", "output_s": 0.003, "think_s": 0.002}
    fast, slow = (run_scenario(parse_scenario({**base, "simulation": {"steady_decode": st}})) for st in (True, False))
    assert fast.requests[COLUMNS].equals(slow.requests[COLUMNS])
    assert_step_tables_agree(fast.step_table, slow.step_table)
    assert fast.summary["num_steps"] == slow.summary["num_steps"]


@pytest.mark.parametrize("seed", [s for s in range(40) if random_scenario(s)["workload"]["arrival"]["type"] == "concurrency"][:6])
def test_steady_equals_plain_for_a_closed_loop_through_an_http_client(seed):
    """A closed loop through an HTTP client: each send waits for the client to read a response
    (output_s after the last token) and for its turnaround; fast steps stop at those reads and
    give the plain steps' records and step rows."""
    base = random_scenario(seed)
    base["workload"]["client"] = {"type": "http", "output_s": 0.003, "think_s": 0.002}
    fast, slow = (run_scenario(parse_scenario({**base, "simulation": {"steady_decode": st}})) for st in (True, False))
    assert fast.requests[COLUMNS].equals(slow.requests[COLUMNS])
    assert_step_tables_agree(fast.step_table, slow.step_table)
    assert fast.summary["client"]["turnaround_applied"] and fast.summary["num_steps"] == slow.summary["num_steps"]
