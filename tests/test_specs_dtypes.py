"""Model/device specs: separate weight, KV and activation dtypes; KV heads per GPU computed once
and used by memory accounting and the cost models alike; forgiving names; HF config.json."""
import json

import pytest

from sim.cost_model import AnalyticCostModel
from sim.kernel_model import KernelCostModel
from sim.specs import GiB, get_device, get_model, kv_cache_blocks, memory_breakdown
from sim.scenario import ScenarioError, parse_scenario

L8 = dict(layers=32, h=4096, inter=14336, vocab=128256)
WORKLOAD = {"num_requests": 4, "arrival": {"type": "poisson", "rate": 1},
            "prompt_len": {"type": "fixed", "value": 64}, "output_len": {"type": "fixed", "value": 8}}


def test_fp8_weights_halve_linear_bytes_but_not_kv_embeddings_or_head():
    bf16 = get_model("llama-3.1-8b")
    fp8 = bf16.with_dtypes(weight_dtype="fp8")
    h, layers = L8["h"], L8["layers"]
    linear = layers * (h * (4096 + 2 * 1024) + 4096 * h + 3 * h * L8["inter"])
    dense = 2 * L8["vocab"] * h + (2 * layers + 1) * h              # embeddings, LM head, norms
    assert bf16.weight_bytes == 2 * linear + 2 * dense
    assert fp8.weight_bytes == linear + 2 * dense                     # only the linear layers halve
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token == 2 * layers * 8 * 128 * 2
    assert fp8.kv_dtype == "bfloat16" and fp8.act_dtype == "bfloat16"
    kv8 = fp8.with_dtypes(kv_dtype="fp8")
    assert kv8.kv_bytes_per_token == bf16.kv_bytes_per_token // 2     # only when asked for
    # More room for KV on the same GPU with fp8 weights, twice the tokens per byte with fp8 KV.
    dev = get_device("h100-sxm")
    assert kv_cache_blocks(fp8, dev) > kv_cache_blocks(bf16, dev)
    assert kv_cache_blocks(kv8, dev) == pytest.approx(2 * kv_cache_blocks(fp8, dev), abs=2)


def test_scenario_dtype_key_sets_weights_only_and_kv_dtype_is_separate():
    base = {"workload": WORKLOAD, "cost_model": {"type": "analytic"}}
    old = parse_scenario({**base, "deployment": {"model": "llama-3.1-8b", "dtype": "fp8"}})
    new = parse_scenario({**base, "deployment": {"model": "llama-3.1-8b", "weight_dtype": "fp8"}})
    plain = parse_scenario({**base, "deployment": {"model": "llama-3.1-8b"}})
    kv = parse_scenario({**base, "deployment": {"model": "llama-3.1-8b", "weight_dtype": "fp8", "kv_dtype": "fp8"}})
    for sc in (old, new):
        assert sc.deployment["weight_dtype"] == "fp8" and sc.deployment["kv_dtype"] == "bfloat16"
    assert old.scheduler_config.num_gpu_blocks == new.scheduler_config.num_gpu_blocks
    assert plain.scheduler_config.num_gpu_blocks < new.scheduler_config.num_gpu_blocks
    assert kv.scheduler_config.num_gpu_blocks > 1.9 * new.scheduler_config.num_gpu_blocks
    with pytest.raises(ScenarioError, match="kv_dtype"):
        parse_scenario({**base, "deployment": {"model": "llama-3.1-8b", "kv_dtype": "int3"}})


def test_fp8_peak_is_twice_bf16_and_used_for_fp8_gemms():
    for name in ("h100-sxm", "h200", "b200"):
        d = get_device(name)
        assert d.peak_flops("fp8") == pytest.approx(2 * d.peak_flops("bf16"), rel=0.01)
    bf16 = AnalyticCostModel("llama-3.1-70b", "h100-sxm", 4)
    fp8 = AnalyticCostModel(get_model("llama-3.1-70b").with_dtypes(weight_dtype="fp8"), "h100-sxm", 4)
    assert fp8._flop_time_per_token < 0.6 * bf16._flop_time_per_token
    assert fp8._comm_per_token == bf16._comm_per_token                # all-reduce stays bf16
    assert fp8._kv_time_per_token == bf16._kv_time_per_token          # KV stays bf16


def test_kv_heads_replicated_past_tp_in_memory_and_cost_alike():
    m = get_model("llama-3.1-70b")                                    # 8 KV heads
    assert [m.kv_heads_per_gpu(t) for t in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert m.kv_bytes_per_token_per_gpu(16) == m.kv_bytes_per_token_per_gpu(8) == 2 * 80 * 128 * 2
    dev = get_device("h100-sxm")
    assert memory_breakdown(m, dev, 16)["kv_bytes_per_token_per_gpu"] == m.kv_bytes_per_token_per_gpu(8)
    c8, c16 = AnalyticCostModel(m, dev, 8), AnalyticCostModel(m, dev, 16)
    assert c16._kv_time_per_token == c8._kv_time_per_token           # not halved again
    k8, k16 = KernelCostModel(m, dev, 8), KernelCostModel(m, dev, 16)
    assert k8.kv_heads == k16.kv_heads == 1
    # and the replicated head's k/v projection is in every GPU's weights
    assert m.gemm_shapes(16)["qkv"][0] == (64 // 16 + 2) * 128


def test_input_embedding_is_not_a_weight_read():
    m = get_model("llama-3.1-8b")
    emb = L8["vocab"] * L8["h"] * 2
    assert m.weight_read_bytes_per_gpu(1) == m.weight_bytes - emb
    tied = get_model("llama-3.2-1b")                                  # tied: the head reads the table
    assert tied.weight_read_bytes_per_gpu(1) == tied.weight_bytes
    a = AnalyticCostModel(m, "h100-sxm", 1)
    assert a._w_time == pytest.approx((m.weight_bytes - emb) / (3.35e12 * 0.75))


@pytest.mark.parametrize("name,expect,fp8", [
    ("llama-3.1-8b", "llama-3.1-8b", False), ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", False),
    ("Llama-3.1-70B", "llama-3.1-70b", False), ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.1-70b", False),
    ("RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8", "llama-3.1-70b", True), ("Qwen/Qwen3-32B", "qwen3-32b", False),
    ("Qwen3-32B-FP8", "qwen3-32b", True),
    # ModelOpt's static per-tensor scales: per-tensor fp8 even under a block-fp8 publisher's name
    ("Qwen/Qwen3-32B-FP8-Static-PerTensor", "qwen3-32b", True)])
def test_model_names_are_forgiving(name, expect, fp8):
    m = get_model(name)
    assert m.name == expect and (m.weight_dtype == "fp8") == fp8


@pytest.mark.parametrize("name,expect", [("h100-sxm", "h100-sxm"), ("h100_sxm", "h100-sxm"), ("H100", "h100-sxm"),
                                         ("h200", "h200"), ("h200_sxm", "h200"), ("b200", "b200"),
                                         ("B200_SXM", "b200")])
def test_device_names_are_forgiving(name, expect):
    assert get_device(name).name == expect


def test_model_from_a_local_hf_config(tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 4,
           "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
           "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
    d = tmp_path / "tiny-qwen3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    base = {"workload": WORKLOAD, "cost_model": {"type": "analytic"}}
    a = parse_scenario({**base, "deployment": {"model": "tiny-qwen3/config.json", "device": "h100"}}, base_dir=tmp_path)
    b = parse_scenario({**base, "deployment": {"model": "mine", "model_config": str(d), "device": "h100"}})
    for sc in (a, b):
        m = sc.cost_model.model
        assert (m.num_layers, m.head_dim, m.num_kv_heads, m.qk_norm, m.tie_word_embeddings) == (4, 128, 8, True, True)
    assert b.deployment["model"] == "mine"
    with pytest.raises(ScenarioError, match="no such config.json"):
        parse_scenario({**base, "deployment": {"model": str(tmp_path / "nope" / "config.json")}})


def test_memory_reserve_is_vllm_like_and_grows_with_the_batch_budget():
    m, dev = get_model("llama-3.1-8b"), get_device("h100-sxm")
    small = memory_breakdown(m, dev, 1, max_num_batched_tokens=2048, max_num_seqs=256)
    big = memory_breakdown(m, dev, 1, max_num_batched_tokens=16384, max_num_seqs=1024)
    assert 1 * GiB < small["reserve_bytes"] < big["reserve_bytes"] < 6 * GiB
    assert small["kv_blocks"] > big["kv_blocks"]


def test_block_fp8_checkpoint_is_its_own_weight_format():
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
           "intermediate_size": 1024, "vocab_size": 1000, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    from sim.specs import ModelSpec
    blk = ModelSpec.from_hf_config(cfg)
    del cfg["quantization_config"]["weight_block_size"]
    per_tensor = ModelSpec.from_hf_config(cfg)
    assert (blk.weight_dtype, per_tensor.weight_dtype) == ("fp8_block", "fp8")
    assert blk.weight_bytes == per_tensor.weight_bytes and blk.kv_dtype == "bfloat16"
    k = KernelCostModel(get_model("qwen3-32b").with_dtypes(weight_dtype="fp8_block"), "h200", 2)
    assert k.describe()["table_coverage"]["gemm"] is True


@pytest.mark.parametrize("product, name, gib", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm", 79.19), ("NVIDIA A100-SXM4-80GB", "a100-80g", 79.15),
    ("NVIDIA A100-SXM4-40GB", "a100-40g", 39.59), ("NVIDIA L40S", "l40s", 44.39), ("NVIDIA A10G", "a10g", 22.03),
    ("NVIDIA B300 SXM6 AC", "b300", 267.69)])
def test_devices_by_nvidia_smi_name_with_the_memory_cuda_reports(product, name, gib):
    """nvidia-smi's product name finds the device, whose memory is the total CUDA reports (what
    vLLM multiplies by gpu_memory_utilization; vLLM's H100 logs print 79.19 GiB), below both the
    marketing size and nvidia-smi's memory.total (an L40S: 48 GB, 46068 MiB, 44.39 GiB)."""
    dev = get_device(product)
    assert dev.name == name and dev.memory_bytes == round(gib * 2 ** 30)
    assert dev.memory_bytes < {"h100-sxm": 81559, "a100-80g": 81920, "a100-40g": 40960, "l40s": 46068,
                               "a10g": 23028, "b300": 275040}[name] * 2 ** 20
    with pytest.raises(ScenarioError, match="H100 PCIe"):  # another part: never read as the SXM one
        parse_scenario({"deployment": {"model": "llama-3.1-8b", "device": "NVIDIA H100 PCIe"}, "workload": WORKLOAD})


def test_fp8_weights_on_a_gpu_without_fp8_tables_read_the_nearest_table_at_the_rooflines_ratio():
    # A100 has only bf16 GEMM tables and no fp8 tensor cores: fp8 weights go at bf16's math rate
    # with half the weight bytes. Each (M, N, K) of the bf16 table is scaled by the ratio of the
    # two rooflines there, so a large prefill (compute-bound) costs what bf16 costs, and a decode
    # batch (weight-bound) about half; every lookup is counted as a fallback.
    from engine.core.features import BatchFeatures
    m = get_model("llama-3.1-8b")
    bf16, fp8 = KernelCostModel(m, "a100-80g"), KernelCostModel(m.with_dtypes(weight_dtype="fp8"), "a100-80g")
    assert fp8.describe()["table_coverage"]["gemm"] is False
    assert fp8.describe()["table_coverage"]["gemm_derived"] == {"fp8": "bf16 table x roofline ratio"}
    prefill = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=4096, prefill_attn_pairs=4096 * 4097 // 2)
    decode = BatchFeatures(num_reqs=8, num_decode_reqs=8, decode_context_tokens=8 * 1000)
    assert fp8.breakdown(prefill)["gemm"] == pytest.approx(bf16.breakdown(prefill)["gemm"], rel=0.02)
    assert 0.45 < fp8.breakdown(decode)["gemm"] / bf16.breakdown(decode)["gemm"] < 0.7
    before = sum(fp8.fallbacks.values())
    fp8.gpu_time(decode)
    assert sum(fp8.fallbacks.values()) > before
    # L40S has per-channel fp8 tables but no 128x128-block ones: blocks read the fp8 table as is
    blk = KernelCostModel(m.with_dtypes(weight_dtype="fp8_block"), "l40s")
    per = KernelCostModel(m.with_dtypes(weight_dtype="fp8"), "l40s")
    assert blk.describe()["table_coverage"]["gemm_derived"] == {"fp8_block": "fp8 table x roofline ratio"}
    assert blk.breakdown(decode)["gemm"] == pytest.approx(per.breakdown(decode)["gemm"], rel=1e-9)
    # GPUs with the format's own table are untouched
    assert "gemm_derived" not in KernelCostModel(m.with_dtypes(weight_dtype="fp8"), "h100").describe()["table_coverage"]


W4A16_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
             "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 131072,
             "torch_dtype": "bfloat16", "tie_word_embeddings": False,
             "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                         "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                         "group_size": 128}}},
                                     "ignore": ["lm_head"]}}


def test_int4_weights_w4a16_by_config_and_by_name(tmp_path):
    # A dense W4A16 checkpoint (RedHatAI's Meta-Llama-3.1-70B-Instruct-quantized.w4a16): every
    # linear layer in 4 bits with a 16-bit scale per 128 weights, embeddings, LM head and norms in
    # 16 bits. It was read as bf16 (141 GB) before.
    (tmp_path / "config.json").write_text(json.dumps(W4A16_70B))
    m = get_model(str(tmp_path / "config.json"))
    h, layers, inter, vocab = 8192, 80, 28672, 128256
    linear = layers * (h * (h + 2 * 1024) + h * h + 3 * h * inter)
    dense = 2 * vocab * h + (2 * layers + 1) * h
    assert m.weight_dtype == "int4" and m.expert_dtype == ""
    assert m.weight_bytes == pytest.approx(linear * (0.5 + 2 / 128) + 2 * dense, rel=1e-9)
    assert m.kv_bytes_per_token == get_model("llama-3.1-70b").kv_bytes_per_token
    # the same by the checkpoints' names, AWQ and GPTQ alike
    for name in ("neuralmagic/Meta-Llama-3.1-70B-Instruct-quantized.w4a16", "hugging-quants/"
                 "Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "meta-llama/Llama-3.1-70B-Instruct-GPTQ-Int4"):
        named = get_model(name)
        assert named.name == "llama-3.1-70b" and named.weight_dtype == "int4", name
        assert named.weight_bytes == pytest.approx(m.weight_bytes, rel=1e-9), name
    moe = get_model("Qwen/Qwen3-30B-A3B-GPTQ-Int4")  # experts and attention alike
    assert moe.weight_dtype == "int4" and moe.expert_dtype_bytes == 0.5 + 2 / 128
    # AWQ's and GPTQ's own configs (groups of 32 their own format, other groups and per-channel
    # scales read as groups of 128); another width is refused by field. A dense model is 4-bit
    # throughout even where its ignore list names one attention projection.
    ct = W4A16_70B["quantization_config"]
    for q, want in (({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "int4"),
                    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "int4_g32"),
                    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "int4"),
                    ({**ct, "ignore": ["lm_head", "model.layers.0.self_attn.o_proj"]}, "int4"),
                    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"quantization_config.bits=8")):
        (tmp_path / "config.json").write_text(json.dumps({**W4A16_70B, "quantization_config": q}))
        if want.startswith("int4"):
            assert get_model(str(tmp_path / "config.json")).weight_dtype == want, q
        else:
            with pytest.raises(ValueError, match=want):
                get_model(str(tmp_path / "config.json"))
    # a weight format, never a KV cache's
    with pytest.raises(ValueError, match="are weight formats"):
        get_model("llama-3.1-8b").with_dtypes(kv_dtype="int4")


def test_int4_gemms_stream_a_quarter_of_the_bytes_and_do_bf16_math():
    # No table holds W4A16 GEMMs: the bf16 table times the two rooflines' ratio. A one-token
    # decode streams the weights (0.516 bytes a weight against 2), a long prefill is bf16 math.
    from sim.cost_model import BatchFeatures
    def gemm(dtype, f):
        k = KernelCostModel(get_model("llama-3.1-8b").with_dtypes(weight_dtype=dtype), "h100-sxm", 1)
        return k.breakdown(f)["gemm"], k
    one = BatchFeatures(num_reqs=1, num_decode_reqs=1, decode_context_tokens=100)
    big = BatchFeatures(num_reqs=8, num_prefill_reqs=8, num_prefill_tokens=8192, prefill_attn_pairs=8 * 1024 * 1025 // 2)
    (b1, _), (q1, k) = gemm("bfloat16", one), gemm("int4", one)
    (b8, _), (q8, _) = gemm("bfloat16", big), gemm("int4", big)
    assert 0.2 < q1 / b1 < 0.35
    assert q8 / b8 == pytest.approx(1.0, rel=0.05)
    assert k.describe()["weight_dtype"] == "int4" and k.describe()["fallbacks"].get("gemm", 0) > 0
    # a scenario of it is timed as int4, not by the shipped bf16 profile of the same model and GPU
    sc = parse_scenario({"workload": WORKLOAD, "deployment": {"model": "llama-3.1-8b", "weight_dtype": "awq",
                                                               "device": "h100-sxm"}})
    assert sc.cost_model.describe()["weight_dtype"] == "int4"
    from scenarios.candidates import hf_checkpoint
    assert hf_checkpoint("llama-3.1-8b", "int4", "bfloat16")[0].startswith("<a 4-bit AWQ/GPTQ checkpoint of ")
    assert hf_checkpoint("Qwen/Qwen3-32B-AWQ", "int4", None) == ("Qwen/Qwen3-32B-AWQ", None)
