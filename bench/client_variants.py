"""Client and async-scheduling variants against allowed silicon rows: vLLM on B200, Llama-3.1-70B fp8.

    nice -n 19 .venv/bin/python bench/client_variants.py [MAX_OSL] [BUDGET]

For every row (TP 1-8, ISL/OSL 1k/8k, concurrency 4-64) the matching `workload.benchmark` scenario
(num_prompts 5 x c, at least 20) runs with the kernel-table cost model in four variants:
lockstep (engine-direct client: the pre-issue-9 behaviour) or http (sim/clients.py defaults),
sync or async scheduling (sim/cpu_work.py). Prints median |error| and median signed error of
mean TTFT and mean TPOT per variant. Only vLLM rows on b200_sxm are selected; the held-out vLLM
rows on h100_sxm / h200_sxm are dropped before anything is looked at.
"""
import sys
import warnings

import pandas as pd

from sim.scenario import parse_scenario, run_scenario

warnings.filterwarnings("ignore")
MAX_OSL = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
BUDGET = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
VARIANTS = {"lockstep-sync": ("engine_direct", False), "http-sync": ("http", False),
            "lockstep-async": ("engine_direct", True), "http-async": ("http", True)}

from silicon_check import default_csv  # noqa: E402  (bench/)
path = default_csv()
if path is None:
    sys.exit("set SILICON_SAMPLE (or AISIMULATE) to find aisimulate's silicon_sample.csv")
df = pd.read_csv(path)
df = df[(df.backend == "vllm") & (df.system == "b200_sxm")]  # allowed rows only
rows = df[df.model_path.str.contains("Llama-3.1-70B") & (df.precision == "fp8") & (df.osl <= MAX_OSL)]
out = []
for r in rows.itertuples():
    c = int(r.batch_size)
    for name, (client, asy) in VARIANTS.items():
        wl = {"benchmark": {"concurrency": c, "isl": int(r.isl), "osl": int(r.osl),
                            "num_prompts": max(5 * c, 20)}, "client": {"type": client}}
        sc = parse_scenario({"deployment": {"model": "llama-3.1-70b", "weight_dtype": "fp8", "device": "b200",
                                            "tp": int(r.tp_size)},
                             "scheduler": {"async_scheduling": asy, "max_num_batched_tokens": BUDGET},
                             "workload": wl})
        s = run_scenario(sc).summary
        out.append({"variant": name, "tp": int(r.tp_size), "isl": r.isl, "osl": r.osl, "c": c,
                    "ttft_err": s["ttft_s"]["mean"] * 1e3 / r.silicon_ttft_ms - 1,
                    "tpot_err": s["tpot_s"]["mean"] * 1e3 / r.silicon_tpot_ms - 1})
t = pd.DataFrame(out)
g = t.groupby("variant")
print(pd.DataFrame({"ttft_median_abs": g.ttft_err.agg(lambda x: x.abs().median()), "ttft_bias": g.ttft_err.median(),
                    "tpot_median_abs": g.tpot_err.agg(lambda x: x.abs().median()), "tpot_bias": g.tpot_err.median(),
                    "rows": g.size()}).round(3).to_string())
print(t.pivot_table(index=["tp", "isl", "osl", "c"], columns="variant", values="ttft_err").round(2).to_string())
