"""PNG plots of a run: latency CDFs, and KV usage and batch size over time."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _cdf(ax, values, weights, label):
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return
    order = np.argsort(v)
    v = v[order]
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)[order]
    c = np.cumsum(w) / w.sum()
    ax.step(v * 1e3, c, where="post", label=label)


def write_plots(result, out: Path) -> list[Path]:
    df = result.requests
    done = df["finish_reason"].isin(["stop", "length"])
    paths = []

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"), ("itl_s", "ITL")]
    for ax, (col, title) in zip(axes.flat, panels):
        if col == "itl_s":
            vals, weights = result.itl
            _cdf(ax, vals, weights, title)
        else:
            _cdf(ax, df.loc[done, col].dropna(), None, title)
        slo = (result.summary.get("slo") or {}).get(col)
        if slo:
            ax.axvline(slo * 1e3, color="red", linestyle="--", label=f"SLO {slo * 1e3:g} ms")
            ax.legend(loc="lower right")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if col != "itl_s" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "latency_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    steps = result.steps
    if len(steps):
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        for rep, s in steps.groupby("replica"):
            ax1.plot(s["end_s"], s["kv_usage"] * 100, lw=0.8, label=f"replica {rep}")
            ax2.plot(s["end_s"], s["num_running"], lw=0.8, label=f"running, replica {rep}")
            ax2.plot(s["end_s"], s["num_waiting"], lw=0.8, ls="--", label=f"waiting, replica {rep}")
        ax1.set_ylabel("KV blocks used (%)")
        ax1.set_ylim(0, 105)
        ax2.set_ylabel("requests")
        ax2.set_xlabel("simulated time (s)")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
        if steps["replica"].nunique() <= 4:
            ax1.legend(loc="upper right", fontsize=8)
            ax2.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        p = out / "kv_and_batch.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
