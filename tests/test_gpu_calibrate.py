"""calibration/gpu_calibrate.sh: the GPU pipeline, run on the CPU with tiny sizes (--dry-run)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from calibration.gpu_calibrate import GPU, LLAMA_31_8B
from sim.cost_model import check_profile
from sim.specs import get_model

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "calibration" / "gpu_calibrate.sh"


def test_dry_run_writes_every_output(tmp_path):
    out = tmp_path / "cal"
    # (arguments after -- reach gpu_calibrate.py: here the greedy check on the default model)
    proc = subprocess.run([str(SCRIPT), str(out), "--dry-run", "--", "--greedy-model", "default"], cwd=REPO,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["environment"]["dry_run"] is True
    st = s["stages"]
    assert st["checks"]["attention"]["ok"] and st["checks"]["greedy"]["ok"]
    assert st["checks"]["greedy"]["model"] == "default"
    for name in ("smollm2-135m", "tiny-llama-random"):
        prof = json.loads((out / "profiles" / f"{name}.json").read_text())
        check_profile(prof, name)  # a loadable fitted profile
        assert prof["metadata"]["num_samples"] >= 8 and (out / "profiles" / f"{name}.steps.csv").exists()
        # The recipe sweeps other settings' shapes too (wider decode batches, small and large
        # budgets) and cross-validates the fit across them.
        gs = prof["metadata"]["group_settings"]
        assert {"c4-short", "b16-c2-medium", "b128-c2-medium"} <= set(gs) and gs["b16-c2-medium"]["max_num_batched_tokens"] == 16
        assert {"budget 16", "budget 128"} <= set(prof["metadata"]["cv_by_setting"])
        val = json.loads((out / f"validate-{name}" / "validation.json").read_text())
        assert val["summary"]["rows"] > 0
        assert st[name]["validation"]["rows"] == val["summary"]["rows"]
    assert json.loads((out / "profiles" / "tiny-llama-random.json").read_text())["metadata"]["model"] == "tiny-llama"
    for f in ("run.log", "tests.log", "checks.json"):
        assert (out / f).stat().st_size > 0


def test_bad_arguments_exit_2(tmp_path):
    for args in ([], ["--bogus", str(tmp_path)], [str(tmp_path), str(tmp_path)]):
        proc = subprocess.run([str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "usage" in proc.stderr


def test_random_8b_shape_is_the_catalogs_and_loads_without_files():
    spec = get_model("llama-3.1-8b")
    c = LLAMA_31_8B
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["intermediate_size"], c["vocab_size"]) == (
        spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
        spec.intermediate_size, spec.vocab_size)
    assert "random:llama-3.1-8b" in GPU.models and "default" in GPU.models
    from engine.model.loader import load_model
    net, tok, cfg = load_model("random:tiny-llama", "cpu")
    assert tok is None and net.config.num_layers == 2 and cfg.vocab_size == 512


def test_kernel_comparison_reads_calibrate_steps(tmp_path):
    from calibration.gpu_calibrate import compare_kernels
    from calibration.fit import FEATURES
    rows = [dict(num_reqs=8, num_tokens=8, num_prefill_reqs=0, prefill_attn_pairs=0, prefill_context_tokens=0,
                 decode_context_tokens=8 * 700),
            dict(num_reqs=3, num_tokens=1026, num_prefill_reqs=1, prefill_attn_pairs=1024 * 1025 // 2,
                 prefill_context_tokens=0, decode_context_tokens=2 * 300)]
    csv = tmp_path / "s.steps.csv"
    csv.write_text("group," + ",".join(FEATURES) + ",period_s,step_s,forward_s\n" + "".join(
        "g," + ",".join(str(r[k]) for k in FEATURES) + ",0.02,0.02,0.015\n" for r in rows))
    res = compare_kernels(csv, "h100-sxm", tmp_path / "cmp.json")
    assert res["steps"] == 2 and res["decode_only_median_rel_error"] is not None
    assert json.loads((tmp_path / "cmp.json").read_text()) == res
    assert "skipped" in compare_kernels(csv, "no-such-gpu", tmp_path / "none.json")


def test_random_smollm2_shape_is_the_default_models_config():
    """random:smollm2-135m (the default model's shape where its package cannot be installed, e.g.
    on a GPU machine with no registry) has the converted default model's own config."""
    from engine.model.loader import RANDOM_SHAPES, model_label, resolve_model
    hf = json.loads((resolve_model("default") / "config.json").read_text())
    shape = RANDOM_SHAPES["smollm2-135m"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
                  "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "eos_token_id"):
        assert shape[field] == hf[field], field
    assert shape["rope_theta"] == hf.get("rope_theta", hf.get("rope_parameters", {}).get("rope_theta"))
    # labels keep a shape's dots (profiles/llama-3.1-8b-random.json), and drop a file's .json
    assert model_label("random:llama-3.1-8b") == "llama-3.1-8b-random"
    assert model_label("random:/x/qwen3-0.6b.json") == "qwen3-0.6b-random"


@pytest.mark.parametrize("script", ["gpu_sustained_check.py", "gpu_moe_check.py"])
def test_device_bench_dry_runs(tmp_path, script):
    """The device benches' code paths on the CPU (tiny sizes): each writes its JSON, and the MoE
    one's Triton grouped GEMM (interpreter) equals the torch loop."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--dry-run", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] is True
    if script == "gpu_moe_check.py":
        assert [row["tokens"] for row in r["rows"]] == [1, 8]
        for row in r["rows"]:
            assert 1 <= row["experts_touched"] <= r["shape"]["experts"]
            assert row["triton_bm16_rel_max_diff"] < 1e-5 and row["triton_bm64_rel_max_diff"] < 1e-5
    else:
        bf16 = r["dtypes"]["bf16"]
        assert len(bf16["burst_step_ms"]) == 3 and bf16["sustained_steps"] >= 1
        assert bf16["sustained_over_burst"] > 0 and bf16["table_step_ms"] > 0
