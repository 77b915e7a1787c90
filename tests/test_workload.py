"""Workload generation: arrival processes, length distributions, shared prefixes, trace readers,
validation and determinism. Expectations are computed independently (closed-form statistics,
hand-written trace files), never from the module's own helpers."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sim.traces import detect_format, read_trace
from sim.workload import RequestSpec, Workload, WorkloadError, build_workload

FIXED = {"prompt_len": {"type": "fixed", "value": 64}, "output_len": {"type": "fixed", "value": 8}}


def synth(n=100, arrival=None, **kw):
    spec = {"num_requests": n, "arrival": arrival or {"type": "poisson", "rate": 10.0}, **FIXED}
    spec.update(kw)
    return spec


def gaps(w: Workload) -> np.ndarray:
    return np.diff([r.arrival_s for r in w])


# ------------------------------------------------------------------------------ arrivals
def test_poisson_mean_gap_and_cv():
    w = build_workload(synth(20_000, {"type": "poisson", "rate": 5.0}), seed=1)
    g = gaps(w)
    assert w.closed_loop_concurrency is None and len(w) == 20_000
    assert next(iter(w)).arrival_s == 0.0
    assert g.mean() == pytest.approx(0.2, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.04)


@pytest.mark.parametrize("b", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_cv(b):
    w = build_workload(synth(20_000, {"type": "gamma", "rate": 2.0, "burstiness": b}), seed=2)
    g = gaps(w)
    assert g.mean() == pytest.approx(0.5, rel=0.04)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(b), rel=0.06)


def test_constant_exact_spacing():
    w = build_workload(synth(50, {"type": "constant", "rate": 4.0}), seed=0)
    assert [r.arrival_s for r in w] == pytest.approx([i * 0.25 for i in range(50)], abs=1e-12)


def test_closed_loop():
    w = build_workload(synth(30, {"type": "concurrency", "concurrency": 8}), seed=0)
    assert w.closed_loop_concurrency == 8 and len(w) == 30
    assert all(r.arrival_s == 0.0 for r in w)


# ------------------------------------------------------------------------------ lengths
def test_fixed_and_uniform_lengths():
    w = build_workload(synth(5000, prompt_len={"type": "uniform", "min": 32, "max": 512},
                             output_len={"type": "fixed", "value": 17}), seed=3)
    p = np.array([r.prompt_len for r in w])
    assert all(r.output_len == 17 for r in w)
    assert p.min() == 32 and p.max() == 512  # inclusive bounds, both reached with 5000 draws
    assert p.mean() == pytest.approx((32 + 512) / 2, rel=0.02)


def test_lognormal_mean_and_clamp():
    w = build_workload(synth(20_000, prompt_len={"type": "lognormal", "mean": 1000, "sigma": 0.5,
                                                 "max": 10**9}), seed=4)
    p = np.array([r.prompt_len for r in w])
    assert p.mean() == pytest.approx(1000, rel=0.03)  # `mean` is the mean, not the median
    assert np.median(p) == pytest.approx(1000 * math.exp(-0.125), rel=0.03)
    w = build_workload(synth(5000, prompt_len={"type": "lognormal", "mean": 1000, "sigma": 0.8,
                                               "min": 500, "max": 2000}), seed=4)
    p = np.array([r.prompt_len for r in w])
    assert p.min() == 500 and p.max() == 2000  # clamped, and the clamp binds on both sides


def test_trace_length_distribution(tmp_path):
    f = tmp_path / "lens.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
                 "100,7,107,1\n300,9,309,1\n")
    w = build_workload(synth(400, prompt_len={"type": "trace", "path": "lens.csv"},
                             output_len={"type": "trace", "path": str(f), "column": "output_len"}),
                       seed=0, base_dir=tmp_path)
    assert {r.prompt_len for r in w} == {100, 300} and {r.output_len for r in w} == {7, 9}


# ------------------------------------------------------------------------------ prompt content
def test_segments_cover_prompt_and_ids_unique():
    w = build_workload(synth(200, prompt_len={"type": "uniform", "min": 1, "max": 300}), seed=5)
    seen: set[int] = set()
    for r in w:
        ids = r.token_ids()
        assert len(ids) == r.prompt_len == sum(n for _, n in r.segments)
        assert all(type(t) is int and t >= 0 for t in ids)
        assert seen.isdisjoint(ids)  # no sharing configured: no id appears in two requests
        seen.update(ids)


def test_shared_prefix_sharing_and_fraction():
    spec = synth(1000, prompt_len={"type": "uniform", "min": 1, "max": 600},
                 shared_prefix={"num_prefixes": 4, "length": 256, "fraction": 0.8})
    reqs = list(build_workload(spec, seed=6))
    by_prefix: dict[tuple, list[RequestSpec]] = {}
    unique_ids: list[int] = []
    for r in reqs:
        ids = r.token_ids()
        if len(r.segments) == 2 and r.segments[0][1] == 256:
            assert r.prompt_len >= 257
            by_prefix.setdefault(tuple(ids[:256]), []).append(r)
            unique_ids += ids[256:]
        else:
            unique_ids += ids
    assert sum(len(v) for v in by_prefix.values()) == 800  # exactly round(0.8 * 1000)
    assert len(by_prefix) == 4 and min(len(v) for v in by_prefix.values()) > 150  # ~uniform choice
    prefix_ids = [set(p) for p in by_prefix]
    assert all(a.isdisjoint(b) for i, a in enumerate(prefix_ids) for b in prefix_ids[i + 1:])
    # After the prefix every request differs from every other, and unique content never collides.
    assert len(unique_ids) == len(set(unique_ids))
    assert set(unique_ids).isdisjoint(set().union(*prefix_ids))
    a, b = by_prefix[next(iter(by_prefix))][:2]
    ta, tb = a.token_ids(), b.token_ids()
    assert ta[:256] == tb[:256] and ta[256] != tb[256]


def test_shared_prefix_gives_prefix_cache_hits():
    """The real scheduler's prefix cache hits the shared prefix (16 full blocks), nothing more."""
    from tests.helpers import make_request, make_scheduler, step

    spec = synth(2, prompt_len={"type": "fixed", "value": 300},
                 shared_prefix={"num_prefixes": 1, "length": 256, "fraction": 1.0})
    r1, r2 = build_workload(spec, seed=0)
    s = make_scheduler()
    kvm = s.kv_cache_manager
    for r in (r1, r2):
        s.add_request(make_request(r.request_id, tokens=r.token_ids(), max_tokens=2))
        while r.request_id in s.requests:  # live requests only: gone once finished
            step(s)
    assert kvm.num_hit_tokens == 256


def test_cancellation_and_priority():
    spec = synth(1000, output_len={"type": "uniform", "min": 1, "max": 100},
                 priority={"type": "uniform_int", "min": 0, "max": 3},
                 cancellation={"deadline_s": 30, "fraction": 0.1, "at_output_fraction": 0.5})
    reqs = list(build_workload(spec, seed=7))
    assert all(r.cancel_after_s == 30.0 for r in reqs)
    mid = [r for r in reqs if r.cancel_after_tokens is not None]
    assert len(mid) == 100
    assert all(r.cancel_after_tokens == max(1, r.output_len // 2) for r in mid)
    assert {r.priority for r in reqs} == {0, 1, 2, 3}
    plain = list(build_workload(synth(10), seed=7))
    assert all(r.priority == 0 and r.cancel_after_s is None and r.cancel_after_tokens is None
               for r in plain)


# ------------------------------------------------------------------------------ trace readers
AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,0,109\n"
         "2023-11-16 18:16:01.0000000,1200,0\n")
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n10.5,100,5\n11.5,200,6\n13.5,300,7\n"
LENGTHS = ("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
           "3772,54,3826,69.8\n20,3,23,6.6\n")
MOONCAKE_ROWS = [  # (timestamp ms, input_length, output_length, hash_ids)
    (1000, 1200, 10, [0, 1, 2]),
    (2500, 1100, 20, [0, 1, 3]),
    (4000, 600, 30, [7, 8]),
    (4000, 1500, 40, [0]),  # fewer blocks than the prompt needs: the rest is request-unique
]


def write(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    return f


def write_mooncake(tmp_path, rows=MOONCAKE_ROWS, name="mc.jsonl"):
    lines = [json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
             for t, i, o, h in rows]
    return write(tmp_path, name, "\n".join(lines) + "\n")


def test_read_azure(tmp_path):
    f = write(tmp_path, "az.csv", AZURE)
    assert detect_format(f) == "azure"
    df = read_trace(f)
    assert df["arrival_s"].tolist() == pytest.approx([0.0, 4.314579, 14.31941], abs=1e-6)
    assert df["prompt_len"].tolist() == [374, 1, 1200]  # clamped to >= 1
    assert df["output_len"].tolist() == [44, 109, 1]
    assert all(h is None for h in df["hash_ids"])


def test_read_vidur_and_lengths(tmp_path):
    df = read_trace(write(tmp_path, "v.csv", VIDUR))
    assert df["arrival_s"].tolist() == [0.0, 1.0, 3.0]
    assert df["prompt_len"].tolist() == [100, 200, 300] and df["output_len"].tolist() == [5, 6, 7]
    f = write(tmp_path, "l.csv", LENGTHS)
    assert detect_format(f) == "lengths"
    df = read_trace(f)
    assert np.isnan(df["arrival_s"]).all() and df["prompt_len"].tolist() == [3772, 20]


def test_read_mooncake_units(tmp_path):
    f = write_mooncake(tmp_path)
    assert detect_format(f) == "mooncake"
    df = read_trace(f)
    assert df["arrival_s"].tolist() == [0.0, 1.5, 3.0, 3.0]  # ms -> s, from the first row
    assert df["prompt_len"].tolist() == [1200, 1100, 600, 1500]
    assert df["hash_ids"] == [r[3] for r in MOONCAKE_ROWS]


def test_mooncake_hash_ids_share_token_ids(tmp_path):
    write_mooncake(tmp_path)
    a, b, c, d = build_workload({"trace": {"path": "mc.jsonl"}}, seed=0, base_dir=tmp_path)
    assert [r.arrival_s for r in (a, b, c, d)] == [0.0, 1.5, 3.0, 3.0]
    assert [n for _, n in a.segments] == [512, 512, 176]
    ta, tb, tc, td = (r.token_ids() for r in (a, b, c, d))
    assert [len(t) for t in (ta, tb, tc, td)] == [1200, 1100, 600, 1500]
    assert ta[:1024] == tb[:1024]  # hash ids 0, 1 shared
    assert set(ta[1024:]).isdisjoint(tb[1024:])  # blocks 2 vs 3
    assert td[:512] == ta[:512] and set(td[512:]).isdisjoint(set(ta) | set(tb) | set(tc))
    assert set(tc).isdisjoint(set(ta) | set(tb))
    w = build_workload({"trace": {"path": "mc.jsonl"}}, seed=0, base_dir=tmp_path)
    assert w.describe()["ideal_prefix_hit_fraction"] == pytest.approx((1024 + 512) / 4400)


def test_mooncake_hash_keys_do_not_collide_with_unique_keys(tmp_path):
    rows = [(0, 100, 5, [10**12]), (1, 100, 5, [])]  # huge sparse hash id; a row with no blocks
    write_mooncake(tmp_path, rows)
    a, b = build_workload({"trace": {"path": "mc.jsonl"}}, seed=0, base_dir=tmp_path)
    assert set(a.token_ids()).isdisjoint(b.token_ids())
    assert max(a.token_ids() + b.token_ids()) < 2**31  # dense ids


def test_time_scale_and_rate(tmp_path):
    write(tmp_path, "v.csv", VIDUR)  # arrivals 0, 1, 3
    w = build_workload({"trace": {"path": "v.csv", "time_scale": 0.5}}, seed=0, base_dir=tmp_path)
    assert [r.arrival_s for r in w] == [0.0, 0.5, 1.5]
    w = build_workload({"trace": {"path": "v.csv", "rate": 8.0}}, seed=0, base_dir=tmp_path)
    arr = [r.arrival_s for r in w]
    assert arr == pytest.approx([0.0, 0.25 / 3 * 1, 0.25])  # 2 gaps over 0.25 s = 8 req/s
    assert w.describe()["mean_rate_rps"] == pytest.approx(8.0)


def test_tiling_and_start(tmp_path):
    write(tmp_path, "v.csv", VIDUR)
    w = build_workload({"trace": {"path": "v.csv", "max_requests": 8}}, seed=0, base_dir=tmp_path)
    # span 3 s, mean gap 1.5 s: copy t starts at 4.5 t.
    assert [r.arrival_s for r in w] == [0, 1, 3, 4.5, 5.5, 7.5, 9, 10]
    assert [r.prompt_len for r in w] == [100, 200, 300] * 2 + [100, 200]
    w = build_workload({"trace": {"path": "v.csv", "start": 1}}, seed=0, base_dir=tmp_path)
    assert [(r.arrival_s, r.prompt_len) for r in w] == [(0.0, 200), (2.0, 300)]
    w = build_workload({"num_requests": 2, "trace": {"path": "v.csv"}}, seed=0, base_dir=tmp_path)
    assert len(w) == 2


def test_tiling_mooncake_large(tmp_path):
    write_mooncake(tmp_path)
    w = build_workload({"trace": {"path": "mc.jsonl", "max_requests": 1001}}, seed=0,
                       base_dir=tmp_path)
    arr = np.array([r.arrival_s for r in w])
    assert len(w) == 1001 and (np.diff(arr) >= 0).all()
    reqs = list(w)
    # Within a copy, blocks are shared as in the trace; a new copy is new conversations.
    assert reqs[4].token_ids()[:1024] == reqs[5].token_ids()[:1024]
    assert set(reqs[0].token_ids()).isdisjoint(reqs[4].token_ids())


def test_lengths_trace_needs_arrival(tmp_path):
    write(tmp_path, "l.csv", LENGTHS)
    with pytest.raises(WorkloadError, match=r"workload\.arrival: required"):
        build_workload({"trace": {"path": "l.csv"}}, seed=0, base_dir=tmp_path)
    w = build_workload({"trace": {"path": "l.csv", "format": "lengths", "max_requests": 5},
                        "arrival": {"type": "constant", "rate": 2.0},
                        "shared_prefix": {"num_prefixes": 1, "length": 16, "fraction": 1.0}},
                       seed=0, base_dir=tmp_path)
    assert [r.arrival_s for r in w] == [0, 0.5, 1.0, 1.5, 2.0]
    assert [r.prompt_len for r in w] == [3772, 20, 3772, 20, 3772]


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("spec, message", [
    ({"num_requests": 10, "arival": {}, **FIXED}, r"workload\.arival=\{\}: unknown key"),
    (synth(arrival={"type": "poisson", "rate": 1.0, "burstiness": 2}),
     r"workload\.arrival\.burstiness=2: unknown key"),
    (synth(num_requests="10"), r"workload\.num_requests='10': must be an integer"),
    (synth(num_requests=True), r"workload\.num_requests=True: must be an integer"),
    (synth(arrival={"type": "poisson", "rate": -3}), r"workload\.arrival\.rate=-3: must be > 0"),
    (synth(arrival={"type": "weibull", "rate": 1}), r"workload\.arrival\.type='weibull'"),
    (synth(arrival="poisson"), r"workload\.arrival='poisson': must be a mapping"),
    (synth(shared_prefix={"num_prefixes": 2, "length": 8, "fraction": 1.5}),
     r"workload\.shared_prefix\.fraction=1\.5: must be <= 1"),
    (synth(prompt_len={"type": "uniform", "min": 10, "max": 5}),
     r"workload\.prompt_len\.max=5: must be >= 10"),
    (synth(cancellation={"fraction": 0.2}),
     r"workload\.cancellation\.at_output_fraction: required"),
    ({"num_requests": 5, "arrival": {"type": "poisson", "rate": 1},
      "output_len": FIXED["output_len"]}, r"workload\.prompt_len: required"),
    (synth(trace={"path": "nope.csv"}), r"workload\.trace\.path='nope\.csv': no such file"),
])
def test_validation_errors(spec, message, tmp_path):
    with pytest.raises(WorkloadError, match=message):
        build_workload(spec, seed=0, base_dir=tmp_path)


def test_validation_trace_options(tmp_path):
    write(tmp_path, "v.csv", VIDUR)
    with pytest.raises(ValueError,
                       match=r"workload\.trace\.time_scale=0\.5, workload\.trace\.rate=2:"):
        build_workload({"trace": {"path": "v.csv", "time_scale": 0.5, "rate": 2}}, 0, tmp_path)
    with pytest.raises(WorkloadError, match=r"workload\.trace\.start=3: the trace has only 3 rows"):
        build_workload({"trace": {"path": "v.csv", "start": 3}}, 0, tmp_path)
    with pytest.raises(WorkloadError, match=r"workload\.trace\.rate=2: only rescales"):
        build_workload({"trace": {"path": "v.csv", "rate": 2},
                        "arrival": {"type": "poisson", "rate": 1}}, 0, tmp_path)
    write_mooncake(tmp_path)
    with pytest.raises(WorkloadError, match=r"workload\.shared_prefix: cannot combine"):
        build_workload({"trace": {"path": "mc.jsonl"},
                        "shared_prefix": {"num_prefixes": 1, "length": 8}}, 0, tmp_path)


# ------------------------------------------------------------------------------ determinism
FULL = synth(300, {"type": "gamma", "rate": 3.0, "burstiness": 0.5},
             prompt_len={"type": "lognormal", "mean": 400, "sigma": 0.7, "max": 4000},
             output_len={"type": "uniform", "min": 1, "max": 200},
             shared_prefix={"num_prefixes": 3, "length": 64, "fraction": 0.5},
             priority={"type": "uniform_int", "min": 0, "max": 2},
             cancellation={"deadline_s": 10, "fraction": 0.2, "at_output_fraction": 0.3})


def test_same_seed_same_workload_different_seed_differs():
    a, b, c = (list(build_workload(FULL, seed=s)) for s in (11, 11, 12))
    assert a == b
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert [r.prompt_len for r in a] != [r.prompt_len for r in c]


def test_streams_are_independent():
    """Changing the output-length distribution does not move arrivals, prompts or prefixes."""
    other = {**FULL, "output_len": {"type": "fixed", "value": 50}}
    a, b = list(build_workload(FULL, seed=3)), list(build_workload(other, seed=3))
    for x, y in zip(a, b):
        assert (x.arrival_s, x.prompt_len, x.segments, x.priority) == \
               (y.arrival_s, y.prompt_len, y.segments, y.priority)


# ------------------------------------------------------------------------------ Workload object
def test_describe_and_indexing():
    spec = synth(10, {"type": "constant", "rate": 2.0}, prompt_len={"type": "fixed", "value": 100},
                 shared_prefix={"num_prefixes": 1, "length": 32, "fraction": 1.0})
    w = build_workload(spec, seed=0)
    d = w.describe()
    assert d["num_requests"] == 10 and d["mean_rate_rps"] == pytest.approx(2.0)
    assert d["prompt_len"]["mean"] == 100 and d["output_len"]["mean"] == 8
    assert d["shared_prefix_fraction"] == 1.0
    assert d["ideal_prefix_hit_fraction"] == pytest.approx(9 * 32 / 1000)
    assert [w[i] for i in range(len(w))] == list(w) and w[-1] == list(w)[-1]
    assert list(Workload.from_requests(list(w))) == list(w)


def test_build_100k_is_fast():
    spec = synth(100_000, prompt_len={"type": "lognormal", "mean": 1200, "sigma": 0.5},
                 shared_prefix={"num_prefixes": 4, "length": 256, "fraction": 0.8},
                 cancellation={"deadline_s": 30, "fraction": 0.1, "at_output_fraction": 0.5})
    t = time.perf_counter()
    w = build_workload(spec, seed=0)
    assert time.perf_counter() - t < 1.0 and len(w) == 100_000


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), lo=st.integers(1, 50), span=st.integers(0, 100),
       length=st.integers(1, 40), fraction=st.floats(0, 1), seed=st.integers(0, 2**32))
def test_prompt_invariants(n, lo, span, length, fraction, seed):
    spec = synth(n, prompt_len={"type": "uniform", "min": lo, "max": lo + span},
                 shared_prefix={"num_prefixes": 2, "length": length, "fraction": fraction})
    owner: dict[int, int] = {}  # token id -> first segment key that produced it
    for r in build_workload(spec, seed=seed):
        ids = r.token_ids()
        assert len(ids) == r.prompt_len >= 1
        pos = 0
        for key, m in r.segments:
            for t in ids[pos:pos + m]:
                assert owner.setdefault(t, key) == key  # an id only ever comes from one segment key
            pos += m


def test_bad_trace_files(tmp_path):
    write(tmp_path, "bad.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,abc,5\n")
    with pytest.raises(WorkloadError, match=r"workload\.trace\.path='bad\.csv': .*'abc' is not"):
        build_workload({"trace": {"path": "bad.csv"}}, 0, tmp_path)
    write(tmp_path, "what.csv", "a,b\n1,2\n")
    with pytest.raises(WorkloadError, match=r"workload\.trace\.path='what\.csv': .*cannot detect"):
        build_workload({"trace": {"path": "what.csv"}}, 0, tmp_path)
    write(tmp_path, "v.csv", VIDUR)
    with pytest.raises(WorkloadError, match=r"v\.csv.*not in the azure format"):
        build_workload({"trace": {"path": "v.csv", "format": "azure"}}, 0, tmp_path)


def test_trace_lengths_closed_loop(tmp_path):
    write(tmp_path, "az.csv", AZURE)
    w = build_workload({"trace": {"path": "az.csv"}, "output_len": {"type": "fixed", "value": 5},
                        "arrival": {"type": "concurrency", "concurrency": 2}}, 0, tmp_path)
    assert w.closed_loop_concurrency == 2
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in w] == [(0, 374, 5), (0, 1, 5),
                                                                       (0, 1200, 5)]
