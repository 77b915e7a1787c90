"""CPU work around the GPU step, and async scheduling (sim/cpu_work.py)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import SchedulerConfig
from engine.core.features import BatchFeatures
from sim.scenario import ScenarioError, _M, parse_scenario
from sim.cost_model import AnalyticCostModel, CostModel, FittedCostModel
from sim.cpu_work import CpuWork, WithCpuWork, with_cpu_work
from sim.simulation import Simulation
from sim.workload import build_workload

ANALYTIC = AnalyticCostModel("llama-3.1-8b", "h100-sxm", tp=2)


@st.composite
def features(draw):
    f = BatchFeatures()
    for _ in range(draw(st.integers(0, 40))):
        c = draw(st.integers(0, 8000))
        n = 1 if draw(st.booleans()) else draw(st.integers(2, 4096))
        f.add(n, c)
    f.num_reqs = f.num_decode_reqs + f.num_prefill_reqs
    return f


cpus = st.builds(CpuWork, step_s=st.floats(0, 0.02), per_req_s=st.floats(0, 1e-3),
                 per_token_s=st.floats(0, 1e-5), per_output_s=st.floats(0, 1e-4))


@settings(max_examples=300, deadline=None)
@given(f=features(), cpu=cpus)
def test_async_never_slower_than_sync(f, cpu):
    sync = WithCpuWork(ANALYTIC, cpu, async_scheduling=False)
    asyn = WithCpuWork(ANALYTIC, cpu, async_scheduling=True)
    g, c = sync.gpu_time(f), sync.cpu_time(f)
    assert g >= 0 and c >= 0
    assert asyn.step_time(f) <= sync.step_time(f) + 1e-15
    # sync is the sum of the two, async the larger: never below either part.
    if f.num_reqs:
        assert sync.step_time(f) == pytest.approx(c + g)
        assert asyn.step_time(f) == pytest.approx(max(c, g))


def test_analytic_overheads_are_replaced_not_added():
    f = BatchFeatures()
    for _ in range(64):
        f.add(1, 2000)
    f.num_reqs = 64
    e = ANALYTIC.eff
    gpu = ANALYTIC.step_time(f) - e.step_overhead_s - 64 * e.per_req_overhead_s
    w = WithCpuWork(ANALYTIC, CpuWork(step_s=0.0, per_req_s=0.0, per_token_s=0.0), async_scheduling=False)
    assert w.step_time(f) == pytest.approx(gpu)


def test_fitted_engine_profile_cannot_take_cpu_work():
    fitted = FittedCostModel(intercept_s=0.01, per_token_s=1e-5)
    with pytest.raises(ValueError, match="CPU work is inside"):
        WithCpuWork(fitted, CpuWork())
    with pytest.raises(ScenarioError, match="scheduler.async_scheduling"):
        with_cpu_work(_M({"async_scheduling": True}, "scheduler"), fitted)
    # Not asked: a fitted model is left as it is.
    assert with_cpu_work(_M({}, "scheduler"), fitted) is fitted


def test_a_model_with_its_own_cpu_time_is_overlapped_by_default():
    class Kernels(CostModel):
        kind = "kernels"
        metadata = {}

        def gpu_time_fn(self):
            return self.gpu_time

        def cpu_time_fn(self):
            return self.cpu_time

        def gpu_time(self, f):
            return 0.010

        def cpu_time(self, f):
            return 0.004

        def step_time(self, f):
            return self.gpu_time(f) + self.cpu_time(f)

        def describe(self):
            return {"kind": self.kind}

    f = BatchFeatures(num_reqs=1, num_decode_reqs=1, decode_context_tokens=10)
    w = with_cpu_work(_M({}, "scheduler"), Kernels())
    assert w.step_time(f) == pytest.approx(0.010)  # async default: max(cpu, gpu)
    w = with_cpu_work(_M({"async_scheduling": False}, "scheduler"), Kernels())
    assert w.step_time(f) == pytest.approx(0.014)
    w = with_cpu_work(_M({"cpu_work": {"step_s": 0.02, "per_req_s": 0.0}}, "scheduler"), Kernels())
    assert w.step_time(f) == pytest.approx(0.02 + 5e-8)  # the scenario's CPU work (1 token) wins


def test_scenario_switch_changes_decode_period():
    base = {"deployment": {"model": "llama-3.1-8b", "device": "h100-sxm", "num_gpu_blocks": 20000},
            "cost_model": {"type": "analytic"},
            "workload": {"benchmark": {"concurrency": 16, "isl": 256, "osl": 64, "num_prompts": 32}}}
    from sim.scenario import run_scenario
    tpot = {}
    for a in (False, True):
        sc = parse_scenario({**base, "scheduler": {"async_scheduling": a}})
        assert sc.cost_model.describe()["async_scheduling"] is a
        tpot[a] = run_scenario(sc).summary["tpot_s"]["p50"]
    assert tpot[True] < tpot[False]
    with pytest.raises(ScenarioError, match="scheduler.cpu_work.step_s"):
        parse_scenario({**base, "scheduler": {"cpu_work": {"step_s": -1}}})
    with pytest.raises(ScenarioError, match="scheduler.cpu_work.per_reqs"):
        parse_scenario({**base, "scheduler": {"cpu_work": {"per_reqs": 1}}})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_runs_use_the_same_periods(async_scheduling):
    cost = WithCpuWork(ANALYTIC, CpuWork(step_s=4e-3), async_scheduling)
    wl = {"num_requests": 60, "arrival": {"type": "poisson", "rate": 20.0},
          "prompt_len": {"type": "uniform", "min": 50, "max": 900},
          "output_len": {"type": "uniform", "min": 5, "max": 120}}
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096,
                          block_size=16, num_gpu_blocks=4000)
    slow = Simulation(build_workload(wl, 1), cfg, cost, use_steady=False).run()
    fast = Simulation(build_workload(wl, 1), cfg, cost, use_steady=True).run()
    for c in ("first_token_s", "finish_s"):
        assert np.array_equal(slow.request_table[c], fast.request_table[c])


class _Gpu10ms(CostModel):
    """A GPU-only cost model: every step takes 10 ms."""
    kind = "const"
    metadata: dict = {}

    def gpu_time_fn(self):
        return self.step_time

    def step_time(self, f):
        return 0.010

    def describe(self):
        return {"kind": self.kind}


@pytest.mark.parametrize("steady", [False, True])
def test_async_admission_joins_the_step_after_next(steady):
    # Steps of 10 ms from t=0 (request a). b reaches the engine at 15 ms, while step 1
    # [10, 20) ms runs. Sync: scheduled at 20 ms, first token at 30 ms. Async (vLLM's batch
    # queue): step 2 was scheduled at 10 ms, while step 1 ran, so b first runs in step 3
    # [30, 40) ms. c arrives at 100 ms into an idle engine (a ended at 50 ms): no step in
    # flight, so it runs at once either way.
    from sim.workload import RequestSpec, Workload
    specs = [RequestSpec("a", 0.0, 10, 5, ((0, 10),)), RequestSpec("b", 0.015, 10, 2, ((100, 10),)),
             RequestSpec("c", 0.100, 10, 1, ((200, 10),))]
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096,
                          block_size=16, num_gpu_blocks=400)
    first = {}
    for a in (False, True):
        cost = WithCpuWork(_Gpu10ms(), CpuWork(step_s=0.0, per_req_s=0.0, per_token_s=0.0), a)
        res = Simulation(Workload.from_requests(specs), cfg, cost, use_steady=steady).run()
        t = res.request_table
        first[a] = dict(zip(t["request_id"], np.round(t["first_token_s"], 9)))
    assert first[False] == {"a": 0.01, "b": 0.03, "c": 0.11}
    assert first[True] == {"a": 0.01, "b": 0.04, "c": 0.11}
