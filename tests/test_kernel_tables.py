"""The kernel-table cost model: measured points are returned as measured, points between them are
interpolated (log-log), points outside them fall back to the roofline and say so."""
import math
import warnings

import numpy as np
import pytest

from engine.core.features import BatchFeatures
from sim.cost_model import load_profile
from sim.kernel_model import cost_model_from_profile
from sim.kernel_model import Grid, KernelCostModel, load_tables
from sim.specs import get_model


def decode_step(b: int, ctx: int) -> BatchFeatures:
    f = BatchFeatures(num_reqs=b)
    for _ in range(b):
        f.add(1, ctx)
    return f


def prefill_step(n: int, c: int = 0) -> BatchFeatures:
    f = BatchFeatures(num_reqs=1)
    f.add(n, c)
    return f


def test_grid_interpolates_between_measured_points_in_log_space():
    g = Grid([[1, 4, 16]], [10.0, 40.0, 50.0], roofline=lambda m: m)
    assert g(4) == (pytest.approx(40.0), True)                    # a measured point, as measured
    t, exact = g(2)                                               # t ~ m between 1 and 4: 10 * 2
    assert exact and t == pytest.approx(20.0)
    t, exact = g(8)                                               # geometric mean of 40 and 50
    assert exact and t == pytest.approx(math.sqrt(40 * 50))


def test_grid_falls_back_to_the_roofline_outside_and_says_so():
    g = Grid([[1, 4, 16]], [10.0, 40.0, 50.0], roofline=lambda m: 3.0 * m)
    t, exact = g(64)                                              # edge value x roofline(64)/roofline(16)
    assert not exact and t == pytest.approx(50.0 * 4)
    t, exact = g(0.5)
    assert not exact and t == pytest.approx(10.0 * 0.5)


def test_grid_fills_holes_from_the_nearest_measured_point_and_flags_them():
    # 2-D (batch, length): the (4, 8) corner was not measured.
    g = Grid([[1, 4], [2, 8]], [[1.0, 2.0], [3.0, None]], roofline=lambda b, s: b * s)
    t, exact = g(4, 8)
    assert not exact
    assert t in (pytest.approx(3.0 * 32 / 8), pytest.approx(2.0 * 32 / 8))  # from (4, 2) or (1, 8)
    t, exact = g(1, 2)
    assert exact and t == pytest.approx(1.0)
    _, exact = g(2, 4)                                            # uses the hole as a corner
    assert not exact


def test_shipped_h100_gemm_table_is_read_as_measured():
    tab = load_tables("h100_sxm")["gemm"]["bf16"]
    ms, ns, ks = tab["values"]
    i, j, k = ms.index(64), ns.index(4096), ks.index(4096)
    g = Grid(tab["values"], tab["us"], roofline=lambda m, n, k: m * n * k, monotone=False)
    t, exact = g(64, 4096, 4096)
    assert exact and t == pytest.approx(tab["us"][i][j][k])
    # Between two measured widths the time lies between theirs.
    lo, hi = tab["us"][i][ns.index(3584)][k], tab["us"][i][ns.index(5120)][k]
    t, exact = g(64, 4600, 4096)
    assert exact and min(lo, hi) <= t <= max(lo, hi)


def test_kernel_model_counts_fallbacks_and_warns_once():
    k = KernelCostModel(get_model("llama-3.1-8b"), "h100-sxm", 2)
    k.step_time(decode_step(32, 1000))
    k.step_time(prefill_step(2048))
    assert k.fallbacks == {} and k.lookups > 0                   # inside the measured tables
    with pytest.warns(UserWarning, match="outside the measured kernel table"):
        k.step_time(prefill_step(100_000))                       # M past the GEMM table's 32768
    assert k.fallbacks.get("gemm", 0) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")                           # the second time: counted, not warned
        k.step_time(prefill_step(100_000))
    assert k.fallbacks["gemm"] == 2
    assert k.describe()["fallbacks"]["gemm"] == 2


def test_kernel_model_without_a_table_uses_the_roofline_and_says_so():
    # A head dim of 96: no attention table of any head count has it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = KernelCostModel(get_model({"base": "llama-3.1-8b", "name": "hd96", "head_dim": 96}), "h100-sxm", 1)
        assert k.coverage["generation_attention"] is None
        k.step_time(decode_step(8, 500))
    assert k.fallbacks.get("generation_attention") == 1
    # qwen2.5-7b at tp=4: 7 query heads per GPU, a head count the tables do not hold; its
    # neighbours of 6 and 8 query heads per KV head do, so it is interpolated, not a fallback.
    q = KernelCostModel(get_model("qwen2.5-7b"), "h100-sxm", 4)
    assert "between bf16/6/1/128 and bf16/8/1/128" in q.coverage["generation_attention"]
    q.step_time(decode_step(8, 500))
    assert "generation_attention" not in q.fallbacks


def test_decode_step_shape_grows_with_batch_context_and_shrinks_with_tp():
    k1 = KernelCostModel(get_model("llama-3.1-70b"), "h100-sxm", 4)
    k8 = KernelCostModel(get_model("llama-3.1-70b"), "h100-sxm", 8)
    assert k1.gpu_time(decode_step(64, 2000)) > k1.gpu_time(decode_step(8, 2000)) > k1.gpu_time(decode_step(8, 100))
    assert k8.gpu_time(decode_step(8, 1000)) < k1.gpu_time(decode_step(8, 1000))
    # All-reduce is a measured term at TP > 1: 2 per layer + embedding + logits gather.
    assert k8.breakdown(decode_step(8, 1000))["allreduce"] > 0
    # fp8 weights: decode (weight-bound) GEMMs faster than bf16.
    kf = KernelCostModel(get_model("llama-3.1-70b").with_dtypes(weight_dtype="fp8"), "h100-sxm", 4)
    assert kf.breakdown(decode_step(8, 1000))["gemm"] < 0.75 * k1.breakdown(decode_step(8, 1000))["gemm"]


def test_shipped_profile_reproduces_the_tables():
    prof = load_profile("h200-tp4-llama-3.1-70b-fp8")
    assert prof["kind"] == "kernels" and prof["metadata"]["synthetic"] is False
    assert "AIConfigurator" in prof["metadata"]["provenance"]
    from_file = cost_model_from_profile(prof)
    fresh = KernelCostModel(get_model("llama-3.1-70b").with_dtypes(weight_dtype="fp8"), "h200", 4)
    for f in (decode_step(16, 3000), prefill_step(1500, 700)):
        assert from_file.step_time(f) == pytest.approx(fresh.step_time(f), rel=1e-3)


def test_steps_past_the_largest_reduced_grid_keep_growing():
    k = KernelCostModel(get_model("llama-3.1-8b"), "h100-sxm", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = k.breakdown(prefill_step(300_000))["gemm"], k.breakdown(prefill_step(600_000))["gemm"]
    assert b == pytest.approx(2 * a, rel=0.05)                   # compute-bound: linear in tokens


def test_grid_lowers_a_measured_inversion_to_the_time_of_more_work():
    # 4 units measured slower than 8 (an algorithm switch in the benchmark): 4 can be padded to 8.
    g = Grid([[1, 2, 4, 8]], [10.0, 12.0, 30.0, 20.0], roofline=lambda m: m)
    assert g(4) == (pytest.approx(20.0), True)
    assert g(2) == (pytest.approx(12.0), True)                    # already below what follows: kept
    assert Grid([[1, 2, 4, 8]], [10.0, 12.0, 30.0, 20.0], roofline=lambda m: m, monotone=False)(4)[0] == pytest.approx(30.0)
    # Two axes: the least time at or above a point on both.
    g2 = Grid([[1, 2], [1, 2]], [[5.0, 9.0], [7.0, 6.0]], roofline=lambda b, s: b * s)
    assert g2(1, 1)[0] == pytest.approx(5.0)
    assert g2(1, 2)[0] == pytest.approx(6.0)                      # (2, 2) costs 6: (1, 2) no more
    assert g2(2, 1)[0] == pytest.approx(6.0)


def test_shipped_all_reduce_never_gets_faster_with_more_bytes():
    """b200_sxm's 8-GPU table drops from 26 us at 256K elements to 17 us at 512K; the model's
    all-reduce (and so a TP-8 decode step) must still grow with the batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = KernelCostModel(get_model("llama-3.1-70b").with_dtypes(weight_dtype="fp8"), "b200_sxm", 8)
    raw = load_tables("b200_sxm")["allreduce"]["tables"]["8"]
    sizes, us = raw["values"][0], raw["us"]
    assert any(b < a for a, b in zip(us, us[1:]))                 # the table itself has an inversion
    times = [k.g_ar(n)[0] for n in sizes]
    assert all(b >= a for a, b in zip(times, times[1:]))
    steps = [k.gpu_time(decode_step(b, 1024)) for b in (4, 8, 16, 32, 64)]
    assert all(b >= a for a, b in zip(steps, steps[1:]))


def test_a_step_past_the_cuda_graph_sizes_reads_the_all_reduce_timed_outside_graphs():
    """A step of more tokens than vLLM captures runs its all-reduces outside CUDA graphs: each is
    read from `allreduce_eager` (the shipped H100 tables: about 1.15x the graph time at 16 M
    elements), a step inside the graphs from `allreduce`. Llama-3.1-70B at TP 4, 2,048 tokens:
    2,048 x 8,192 = 2**24 elements, a measured size of both tables, 161 all-reduces (two per
    layer and the final norm's), plus the logits gather of the one sampled row (graph table)."""
    from sim.kernel_model import Overheads
    raw = load_tables("h100_sxm")

    def us(table, size):
        t = raw[table]["tables"]["4"]
        return dict(zip(t["values"][0], t["us"]))[size]
    size = 2048 * 8192
    graph_us, eager_us = us("allreduce", size), us("allreduce_eager", size)
    assert 1.05 < eager_us / graph_us < 1.3
    m = get_model("llama-3.1-70b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = KernelCostModel(m, "h100_sxm", 4, overheads=Overheads(cudagraph_max_tokens=512))
        graph = KernelCostModel(m, "h100_sxm", 4, overheads=Overheads(cudagraph_max_tokens=4096))
    assert eager.coverage["allreduce_eager"] is True
    gather = eager.g_ar(-(-m.vocab_size // 4))[0] * 1e-6          # one sampled row's logits
    f = prefill_step(2048)
    assert eager.breakdown(f)["allreduce"] - gather == pytest.approx(161 * eager_us * 1e-6, rel=1e-6)
    assert graph.breakdown(f)["allreduce"] - gather == pytest.approx(161 * graph_us * 1e-6, rel=1e-6)
    # the boundary: 512 tokens fit the graphs (2**22 elements, measured), 513 do not
    inside = eager.breakdown(prefill_step(512))["allreduce"] - gather
    assert inside == pytest.approx(161 * us("allreduce", 512 * 8192) * 1e-6, rel=1e-6)
    past = eager.breakdown(prefill_step(513))["allreduce"] - gather
    assert past > 161 * 1.05 * eager.g_ar(513 * 8192)[0] * 1e-6
    # a decode-only step of 600 requests is past the graphs too
    assert eager.breakdown(decode_step(600, 100))["allreduce"] > graph.breakdown(decode_step(600, 100))["allreduce"]


def test_the_all_reduce_is_read_from_the_tables_of_the_deployments_vllm_release():
    """The graph all-reduce's times changed between vLLM releases (H100: 0.31.0 reads 5.5 us at
    256 K elements and TP 4, 0.14.0-0.24.0 about 11 us). A deployment's vllm_version picks the
    latest release measured at or before it, and the earliest for an older one; the default
    release (0.33) reads 0.31.0. A decode step of 32 requests of Llama-3.1-70B at TP 4: 161
    all-reduces of 32 x 8,192 = 2**18 elements, a measured size, plus the 32 rows' logits gather.
    A profile carries every release and switches the same way."""
    raw = load_tables("h100_sxm")["allreduce_releases"]

    def us(release, size):
        t = raw[release]["tables"]["4"]
        return dict(zip(t["values"][0], t["us"]))[size]
    assert us("0.14.0", 2 ** 18) > 1.5 * us("0.31.0", 2 ** 18)
    m = get_model("llama-3.1-70b")
    f = decode_step(32, 1000)

    def layers_ar(k):
        gather = k.g_ar(32 * -(-m.vocab_size // 4))[0] * 1e-6
        return k.breakdown(f)["allreduce"] - gather
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for version, release in (("0.15.1", "0.14.0"), ("0.19", "0.19.0"), ("0.27.0", "0.24.0"), (None, "0.31.0"),
                                 ("0.10.2", "0.14.0")):
            k = KernelCostModel(m, "h100_sxm", 4, vllm_version=version)
            assert k.metadata["allreduce_release"] == release, version
            assert layers_ar(k) == pytest.approx(161 * us(release, 2 ** 18) * 1e-6, rel=1e-6), version
        prof = cost_model_from_profile(KernelCostModel(m, "h100_sxm", 4).to_profile())
    old = layers_ar(prof)
    prof.set_sampling("model_default", "0.15.1")
    assert layers_ar(prof) == pytest.approx(161 * us("0.14.0", 2 ** 18) * 1e-6, rel=1e-3) and layers_ar(prof) > old


def test_a_scenario_prices_its_release_and_its_gpu_through_the_scenario_path():
    """What a scenario names reaches the kernel model: deployment.vllm_version picks the
    all-reduce release (an H100 TP-4 deployment of 0.15.1 reads 0.14.0, of the default release
    0.31.0; B300's default 0.31.0), and B200's own compute slowdown holds when the scenario's
    cost_model.overheads sets other keys only (as bench/silicon_check.py writes it)."""
    from sim.scenario import parse_scenario

    def cost(device, tp, version=None, overheads=None, model="llama-3.1-70b"):
        dep = {"model": model, "device": device, "tp": tp, "weight_dtype": "fp8",
               **({"vllm_version": version} if version else {})}
        cm = {"type": "kernels", **({"overheads": overheads} if overheads else {})}
        data = {"deployment": dep, "cost_model": cm,
                "workload": {"arrival": {"type": "poisson", "rate": 1.0}, "num_requests": 4,
                             "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = parse_scenario(data).cost_model
        while not isinstance(c, KernelCostModel):
            c = c.base
        return c
    assert cost("h100-sxm", 4, "0.15.1").metadata["allreduce_release"] == "0.14.0"
    assert cost("h100-sxm", 4).metadata["allreduce_release"] == "0.31.0"
    assert cost("b300", 4).metadata["allreduce_release"] == "0.31.0"
    assert cost("b200", 4, "0.19.0").metadata["allreduce_release"] == "0.19.0"
    assert cost("b200", 2, overheads={"cudagraph_max_tokens": 2048}).ovh.gemm_compute_slowdown == 1.25
    assert cost("b200", 2, overheads={"gemm_compute_slowdown": 1.0}).ovh.gemm_compute_slowdown == 1.0


def test_a_step_past_the_cuda_graph_sizes_takes_at_least_the_host_launches():
    """vLLM captures CUDA graphs up to 512 tokens; a larger step with a prefill chunk is launched
    kernel by kernel, so it cannot take less than num_layers x eager_layer_launch_s. Smaller
    steps keep their kernel times, and breakdown() still sums to gpu_time()."""
    from sim.kernel_model import Overheads
    m = get_model("llama-3.1-70b").with_dtypes(weight_dtype="fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = KernelCostModel(m, "b200", 8, overheads=Overheads(eager_layer_launch_s=1e-3, tp_step_s=0.0))
        k0 = KernelCostModel(m, "b200", 8, overheads=Overheads(eager_layer_launch_s=0.0, tp_step_s=0.0))
    floor = m.num_layers * 1e-3                                   # 80 layers x 1 ms
    big, small = prefill_step(1024), prefill_step(512)
    assert k0.gpu_time(big) < floor                               # the kernels alone: a TP8 1k prefill is quick
    assert k.gpu_time(big) == pytest.approx(floor)
    assert sum(k.breakdown(big).values()) == pytest.approx(k.gpu_time(big))
    assert k.breakdown(big)["eager_launch"] == pytest.approx(floor - k0.gpu_time(big))
    assert k.gpu_time(small) == k0.gpu_time(small)               # 512 tokens: inside a graph
    assert k.gpu_time(decode_step(64, 2000)) == k0.gpu_time(decode_step(64, 2000))
    # 600 decodes are past the graph sizes too, but only prefill steps are floored (fitted there).
    assert k.gpu_time(decode_step(600, 2000)) == k0.gpu_time(decode_step(600, 2000))
    # A step whose kernels outlast the launches is not changed.
    huge = prefill_step(8192)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert k0.gpu_time(huge) > floor and k.gpu_time(huge) == k0.gpu_time(huge)


@pytest.mark.parametrize("bad, where", [({"eager_launch": 1e-3}, "overheads.eager_launch: unknown"),
                                        ({"eager_layer_launch_s": -1}, "overheads.eager_layer_launch_s=-1"),
                                        ({"sampler_s": "fast"}, "overheads.sampler_s='fast'")])
def test_overheads_refuse_unknown_keys_and_bad_values_naming_them(bad, where):
    with pytest.raises(ValueError, match=where):
        KernelCostModel(get_model("llama-3.1-8b"), "h100-sxm", 1, overheads=bad)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_step_time_is_step_time_of_the_same_decode_step(async_scheduling):
    """The fast steps' shortcut for a decode-only step gives step_time's float to the bit and
    counts the same lookups and fallbacks, inside the tables, at their edges and past them
    (batch 2048 and contexts of 1M tokens are outside the shipped tables)."""
    from sim.cpu_work import CpuWork, WithCpuWork

    def make():
        k = KernelCostModel(get_model("llama-3.1-8b"), "h100-sxm", 1)
        return k, WithCpuWork(k, None, async_scheduling), WithCpuWork(k, CpuWork(step_s=2e-3), async_scheduling)

    rng = np.random.default_rng(0)
    cases = [(1, 1), (1, 5), (3, 3 * 700), (64, 64 * 1155), (2048, 2048 * 100), (7, 7 * 1_000_000)]
    cases += [(int(n), int(n * c)) for n, c in zip(rng.integers(1, 600, 200), rng.uniform(0.5, 9000, 200))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (ka, *wa), (kb, *wb) = make(), make()
        for _ in range(2):  # the second pass hits every memo
            for n, ctx in cases:
                f = BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=ctx)
                assert kb.decode_step_time(n, ctx) == ka.step_time(f)
                for a, b in zip(wa, wb):
                    assert b.decode_step_time(n, ctx) == a.step_time(f)
    assert kb.lookups == ka.lookups and kb.fallbacks == ka.fallbacks
    assert ka.fallbacks.get("generation_attention", 0) > 0  # the cases reach past the tables


def test_a_gpu_carries_its_own_compute_slowdown_unless_the_scenario_sets_one():
    """B200's compute-bound kernels are priced 1.25x their tables (DeviceSpec.gemm_compute_slowdown),
    H200's at the default 1.13; a scenario's own overheads.gemm_compute_slowdown wins, and so does
    a profile's stored one. An 8,192-token step's GEMMs scale with the factor, a 4-request decode
    step's do not (the factor is 1 at 64 tokens and below)."""
    from sim.kernel_model import Overheads
    m = get_model("llama-3.1-70b").with_dtypes(weight_dtype="fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b200 = KernelCostModel(m, "b200", 2)
        plain = KernelCostModel(m, "b200", 2, {"gemm_compute_slowdown": 1.0})
        mine = KernelCostModel(m, "b200", 2, {"gemm_compute_slowdown": 1.1})
        h200 = KernelCostModel(m, "h200", 2)
        given = KernelCostModel(m, "b200", 2, overheads=Overheads())
    assert b200.ovh.gemm_compute_slowdown == 1.25 and h200.ovh.gemm_compute_slowdown == 1.13
    assert mine.ovh.gemm_compute_slowdown == 1.1 and given.ovh.gemm_compute_slowdown == 1.13
    big = prefill_step(8192)
    assert b200.breakdown(big)["gemm"] == pytest.approx(1.25 * plain.breakdown(big)["gemm"], rel=1e-9)
    assert b200.breakdown(decode_step(4, 2000))["gemm"] == pytest.approx(plain.breakdown(decode_step(4, 2000))["gemm"],
                                                                          rel=1e-12)
    again = cost_model_from_profile(b200.to_profile())
    assert again.ovh.gemm_compute_slowdown == 1.25
    assert again.step_time(big) == pytest.approx(b200.step_time(big), rel=1e-3)  # the profile's reduced grids


def test_compute_slowdown_reaches_every_compute_bound_kernel_of_a_large_step():
    """gemm_compute_slowdown (a GPU busy with a whole step runs slower than the tables'
    microbenchmarks) scales the compute-bound kernels of a large step alike: the dense GEMMs, the
    routed experts' grouped GEMMs (a measured fused-MoE table) and the prefill attention, each by
    the full factor at 8192 tokens. A decode step of four requests is read as measured, and the
    all-reduce (a transfer) is never scaled."""
    plain = KernelCostModel("minimax-m2", "b200", 2, {"gemm_compute_slowdown": 1.0})
    slow = KernelCostModel("minimax-m2", "b200", 2, {"gemm_compute_slowdown": 1.2})
    assert "/" in str(plain.coverage["moe"]) and not str(plain.coverage["moe"]).startswith("scaled")
    a, b = plain.breakdown(prefill_step(8192)), slow.breakdown(prefill_step(8192))
    for term in ("gemm", "moe", "attention"):
        assert a[term] > 0 and b[term] == pytest.approx(1.2 * a[term], rel=1e-9), term
    assert b["allreduce"] == pytest.approx(a["allreduce"], rel=1e-12)
    a, b = plain.breakdown(decode_step(4, 2000)), slow.breakdown(decode_step(4, 2000))
    for term in ("gemm", "moe", "attention", "allreduce"):
        assert b[term] == pytest.approx(a[term], rel=1e-12), term
