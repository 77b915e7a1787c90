"""Serving metrics, defined once for the engine and the simulator.

Definitions (times in seconds; a token's time is the end of the step that produced it):
  TTFT   = first_token_s - arrival_s                         (completed requests)
  TPOT   = (last_token_s - first_token_s) / (num_output_tokens - 1)   (completed, >= 2 tokens)
  ITL    = every gap between consecutive tokens of a request (all requests, for tails)
  E2E    = finish_s - arrival_s                              (completed requests)
  queue  = first_scheduled_s - arrival_s                     (requests that were scheduled)
  completed = finish_reason "stop" or "length"; aborted = "abort"; rejected = "rejected"
  duration_s = last finish - first arrival (the span the throughputs are averaged over)
  throughput.requests_per_s      = completed / duration_s
  throughput.output_tokens_per_s = output tokens of all requests / duration_s
  throughput.total_tokens_per_s  = (prompt tokens of requests that produced a token + output tokens) / duration_s
  goodput_requests_per_s = completed requests meeting every given SLO / duration_s
Percentiles: numpy's 'linear' method (weighted samples behave as if each value were repeated
weight times).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from engine.core.records import RequestRecord

QUANTILES = (50, 90, 95, 99)
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


def weighted_percentiles(values, weights=None, qs=QUANTILES) -> list[float]:
    """Percentiles of a sample where value i appears weights[i] times (numpy 'linear')."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return [float("nan")] * len(qs)
    if weights is None:
        return [float(x) for x in np.percentile(v, qs)]
    w = np.asarray(weights, dtype=np.int64)
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cum = np.cumsum(w)  # cum[i] - 1 is the last expanded index holding v[i]
    n = int(cum[-1])
    out = []
    for q in qs:
        pos = q / 100 * (n - 1)
        lo = int(np.floor(pos))
        hi = min(lo + 1, n - 1)
        vlo = v[np.searchsorted(cum, lo + 1)]
        vhi = v[np.searchsorted(cum, hi + 1)]
        out.append(float(vlo + (vhi - vlo) * (pos - lo)))
    return out


def stats(values, weights=None) -> dict:
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None, "count": 0}
    if weights is None:
        mean, count = float(v.mean()), int(v.size)
    else:
        w = np.asarray(weights, dtype=float)
        mean, count = float((v * w).sum() / w.sum()), int(w.sum())
    p = weighted_percentiles(v, weights)
    return {"mean": mean, **{f"p{q}": x for q, x in zip(QUANTILES, p)}, "count": count}


def requests_frame(records: list[RequestRecord]) -> pd.DataFrame:
    """One row per request with the derived latencies (NaN where undefined)."""
    df = pd.DataFrame({c: [getattr(r, c) for r in records] for c in RequestRecord.COLUMNS})
    for c in ("first_scheduled_s", "first_token_s", "last_token_s", "finish_s"):
        df[c] = pd.to_numeric(df[c], errors="coerce")
    completed = df["finish_reason"].isin(["stop", "length"])
    df["ttft_s"] = (df["first_token_s"] - df["arrival_s"]).where(completed)
    n = df["num_output_tokens"]
    df["tpot_s"] = ((df["last_token_s"] - df["first_token_s"]) / (n - 1)).where(completed & (n > 1))
    df["e2e_s"] = (df["finish_s"] - df["arrival_s"]).where(completed)
    df["queue_s"] = df["first_scheduled_s"] - df["arrival_s"]
    return df


def itl_from_token_times(records: list[RequestRecord]):
    """ITL sample from per-token times (engine logs)."""
    gaps = [np.diff(r.token_times_s) for r in records if r.token_times_s and len(r.token_times_s) > 1]
    return (np.concatenate(gaps) if gaps else np.empty(0)), None


def meets_slo(df: pd.DataFrame, slo: dict | None) -> pd.Series:
    ok = df["finish_reason"].isin(["stop", "length"])
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        limit = (slo or {}).get(key)
        if limit is not None:
            ok &= df[key].fillna(0.0) <= limit
    return ok


def summarize(df: pd.DataFrame, itl_values, itl_weights=None, slo: dict | None = None,
              preemptions: int | None = None) -> dict:
    completed = df["finish_reason"].isin(["stop", "length"])
    start = float(df["arrival_s"].min()) if len(df) else 0.0
    end = float(df["finish_s"].max()) if len(df) and df["finish_s"].notna().any() else start
    duration = max(end - start, 1e-12)
    out_tokens = int(df["num_output_tokens"].sum())
    produced = df["num_output_tokens"] > 0
    prompt_tokens = int(df.loc[produced, "num_prompt_tokens"].sum())
    summary = {
        "ttft_s": stats(df.loc[completed, "ttft_s"].dropna()),
        "tpot_s": stats(df.loc[completed, "tpot_s"].dropna()),
        "itl_s": stats(itl_values, itl_weights),
        "e2e_s": stats(df.loc[completed, "e2e_s"].dropna()),
        "queue_s": stats(df["queue_s"].dropna()),
        "throughput": {
            "requests_per_s": float(completed.sum()) / duration,
            "output_tokens_per_s": out_tokens / duration,
            "total_tokens_per_s": (prompt_tokens + out_tokens) / duration,
        },
        "requests": {
            "total": int(len(df)),
            "completed": int(completed.sum()),
            "aborted": int((df["finish_reason"] == "abort").sum()),
            "rejected": int((df["finish_reason"] == "rejected").sum()),
            "unfinished": int(df["finish_reason"].isna().sum()),
            "preemptions": int(df["num_preemptions"].sum() if preemptions is None else preemptions),
            "prefix_cached_tokens": int(df["num_cached_tokens"].sum()),
        },
        "goodput_requests_per_s": float(meets_slo(df, slo).sum()) / duration,
        "slo": dict(slo or {}),
        "duration_s": duration,
    }
    return summary


def read_request_log(path) -> pd.DataFrame:
    """A request log (the server's --request-log CSV, or a simulator's requests.csv) with the
    latency columns derived by the definitions above."""
    raw = pd.read_csv(path)
    cols = list(RequestRecord.COLUMNS)
    missing = [c for c in cols if c not in raw.columns]
    if missing:
        raise ValueError(f"{path}: not a request log, missing columns {missing}")
    records = []
    for row in raw[cols].itertuples(index=False):
        d = {c: (None if (isinstance(v, float) and np.isnan(v)) else v) for c, v in zip(cols, row)}
        d["request_id"] = str(d["request_id"])
        records.append(RequestRecord(**d))
    df = requests_frame(records)
    if "token_times_s" in raw.columns:
        df["token_times_s"] = raw["token_times_s"].fillna("").astype(str).values
    return df
