"""Serving metrics, defined once for the engine and the simulator.

Definitions (times in seconds; a token's time is the end of the step that produced it):
  TTFT   = first_token_s - arrival_s                         (completed requests)
  TPOT   = (last_token_s - first_token_s) / (num_output_tokens - 1)   (completed, >= 2 tokens)
  ITL    = every gap between consecutive tokens of a request (all requests, for tails)
  E2E    = finish_s - arrival_s                              (completed requests)
  queue  = first_scheduled_s - arrival_s                     (requests that were scheduled;
           from the client's send: the request path to the engine is part of it)
  completed = finish_reason "stop" or "length"; aborted = "abort"; rejected = "rejected"
  truncated = completed with "length" after fewer tokens than requested (prompt + max_tokens
              exceeded max_model_len: engine.core.admission)
  duration_s = last finish (or token) - first arrival, or the cut-off of a truncated run (the
               span the throughputs are averaged over)
  throughput.requests_per_s      = completed / duration_s
  throughput.output_tokens_per_s = output tokens of all requests / duration_s
  throughput.total_tokens_per_s  = (prompt tokens of requests that produced a token + output tokens) / duration_s
  goodput_requests_per_s = completed requests meeting every given SLO / duration_s
Percentiles: numpy's 'linear' method (weighted samples behave as if each value were repeated
weight times).
"""
from __future__ import annotations

from operator import attrgetter

import numpy as np

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


_TIMES = ("first_scheduled_s", "first_token_s", "last_token_s", "finish_s")
DERIVED = ("ttft_s", "tpot_s", "e2e_s", "queue_s")


def request_table(records: list[RequestRecord]) -> dict[str, np.ndarray]:
    """Columns of the records (numpy; NaN where a time is missing) plus the derived latencies.

    The simulator summarises and writes these directly; `requests_frame` wraps them in pandas.
    """
    t: dict[str, np.ndarray] = {}
    for c in RequestRecord.COLUMNS:
        vals = list(map(attrgetter(c), records))
        if c in _TIMES:
            t[c] = np.array(vals, dtype=np.float64)  # None becomes NaN
        elif c in ("request_id", "finish_reason"):
            t[c] = np.array(vals, dtype=object)
        elif c == "arrival_s":
            t[c] = np.array(vals, dtype=np.float64)
        else:
            t[c] = np.array(vals, dtype=np.int64)
    completed = _completed(t)
    n = t["num_output_tokens"]
    with np.errstate(invalid="ignore", divide="ignore"):
        t["ttft_s"] = np.where(completed, t["first_token_s"] - t["arrival_s"], np.nan)
        t["tpot_s"] = np.where(completed & (n > 1),
                               (t["last_token_s"] - t["first_token_s"]) / np.maximum(n - 1, 1), np.nan)
        t["e2e_s"] = np.where(completed, t["finish_s"] - t["arrival_s"], np.nan)
        t["queue_s"] = t["first_scheduled_s"] - t["arrival_s"]
    return t


def requests_frame(records: list[RequestRecord]):
    """One row per request with the derived latencies (NaN where undefined), as a DataFrame."""
    import pandas as pd
    return pd.DataFrame(request_table(records))


def _completed(t) -> np.ndarray:
    fr = np.asarray(t["finish_reason"], dtype=object)
    return (fr == "stop") | (fr == "length")


def truncated(t) -> np.ndarray:
    """Requests that finished by length before the output length they asked for."""
    fr = np.asarray(t["finish_reason"], dtype=object)
    req = _col(t, "num_requested_output_tokens")
    return (fr == "length") & (req > 0) & (_col(t, "num_output_tokens") < req)


def _col(t, c) -> np.ndarray:
    return np.asarray(t[c])


def itl_from_token_times(records: list[RequestRecord]):
    """ITL sample from per-token times (engine logs)."""
    gaps = [np.diff(r.token_times_s) for r in records if r.token_times_s and len(r.token_times_s) > 1]
    return (np.concatenate(gaps) if gaps else np.empty(0)), None


def meets_slo(t, slo: dict | None) -> np.ndarray:
    """Completed requests meeting every given SLO (t: a request table or DataFrame)."""
    ok = _completed(t)
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        limit = (slo or {}).get(key)
        if limit is not None:
            v = _col(t, key).astype(np.float64)
            ok &= np.nan_to_num(v, nan=0.0) <= limit
    return ok


def summarize(t, itl_values, itl_weights=None, slo: dict | None = None,
              preemptions: int | None = None, end_s: float | None = None) -> dict:
    """The summary.json dict (t: a request table or a DataFrame with the same columns).

    The span runs from the first arrival to the last finish or token, or to `end_s` for a run
    cut before every request finished (so unfinished requests' tokens count over the right time).
    """
    completed = _completed(t)
    arrival = _col(t, "arrival_s").astype(np.float64)
    n = len(arrival)
    start = float(arrival.min()) if n else 0.0
    ends = np.concatenate([_col(t, "finish_s").astype(np.float64), _col(t, "last_token_s").astype(np.float64)])
    end = float(np.nanmax(ends)) if n and not np.isnan(ends).all() else start
    if end_s is not None:
        end = max(end, end_s)
    duration = max(end - start, 1e-12)
    out = _col(t, "num_output_tokens")
    out_tokens = int(out.sum())
    prompt_tokens = int(_col(t, "num_prompt_tokens")[out > 0].sum())
    fr = np.asarray(t["finish_reason"], dtype=object)

    def lat(key, mask=completed):
        v = _col(t, key).astype(np.float64)[mask]
        return stats(v[~np.isnan(v)])

    return {
        "ttft_s": lat("ttft_s"),
        "tpot_s": lat("tpot_s"),
        "itl_s": stats(itl_values, itl_weights),
        "e2e_s": lat("e2e_s"),
        "queue_s": lat("queue_s", np.ones(n, dtype=bool)),
        "throughput": {
            "requests_per_s": float(completed.sum()) / duration,
            "output_tokens_per_s": out_tokens / duration,
            "total_tokens_per_s": (prompt_tokens + out_tokens) / duration,
        },
        "requests": {
            "total": int(n),
            "completed": int(completed.sum()),
            "aborted": int((fr == "abort").sum()),
            "rejected": int((fr == "rejected").sum()),
            "truncated": int(truncated(t).sum()),
            "unfinished": int(sum(1 for x in fr if x is None or x != x)),
            "preemptions": int(_col(t, "num_preemptions").sum() if preemptions is None else preemptions),
            "prefix_cached_tokens": int(_col(t, "num_cached_tokens").sum()),
        },
        "goodput_requests_per_s": float(meets_slo(t, slo).sum()) / duration,
        "slo": dict(slo or {}),
        "duration_s": duration,
    }


def write_csv(table: dict, path, columns=None) -> None:
    """A column table as CSV (empty cells for None/NaN), without pandas. Cleaned column by
    column, then written by csv.writerows in one call (a 100k-row table is not a Python loop
    over cells)."""
    import csv
    cols = list(columns or table)
    data = []
    for c in cols:
        v = table[c]
        cells = v.tolist() if hasattr(v, "tolist") else list(v)
        kind = v.dtype.kind if isinstance(v, np.ndarray) else "O"
        if kind == "f":
            nan = np.isnan(v)
            if nan.any():
                for i in np.flatnonzero(nan).tolist():
                    cells[i] = ""
        elif kind == "O":
            cells = ["" if x is None or x != x else x for x in cells]
        data.append(cells)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(zip(*data))


def read_request_log(path):
    """A request log (the server's --request-log CSV, or a simulator's requests.csv) as a
    DataFrame, with the latency columns derived by the definitions above."""
    import pandas as pd
    raw = pd.read_csv(path)
    optional = ("num_requested_output_tokens",)  # logs written before it existed
    cols = [c for c in RequestRecord.COLUMNS if c in raw.columns or c not in optional]
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


def stage_metrics(t, stages: list[dict]) -> list[dict]:
    """Per load stage (requests by arrival in [start_s, end_s] of each stage) and for the whole
    run: TTFT and E2E mean / p90 / p99 and the mean ITL as load-test reports define it,
    (E2E mean - TTFT mean) / (mean output tokens - 1), over completed requests (seconds)."""
    arrival = np.asarray(_col(t, "arrival_s"), dtype=np.float64)
    done = _completed(t)
    out = []
    spans = [(st["start_s"], st["end_s"]) for st in stages] + [(-np.inf, np.inf)]
    for i, (lo, hi) in enumerate(spans):
        sel = done & (arrival >= lo - 1e-9) & (arrival <= hi + 1e-9)
        ttft = np.asarray(_col(t, "ttft_s"), dtype=np.float64)[sel]
        e2e = np.asarray(_col(t, "e2e_s"), dtype=np.float64)[sel]
        outn = np.asarray(_col(t, "num_output_tokens"), dtype=np.float64)[sel]
        rec = {"stage": i if i < len(stages) else "all", "completed": int(sel.sum())}
        for name, v in (("ttft_s", ttft), ("e2e_s", e2e)):
            if v.size:
                p90, p99 = np.percentile(v, [90, 99])
                rec[name] = {"mean": float(v.mean()), "p90": float(p90), "p99": float(p99)}
            else:
                rec[name] = {"mean": None, "p90": None, "p99": None}
        rec["itl_s"] = {"mean": (float((e2e.mean() - ttft.mean()) / (outn.mean() - 1))
                                 if e2e.size and outn.mean() > 1 else None)}
        if i < len(stages):
            rec.update(rate=stages[i]["rate"], duration_s=stages[i]["duration_s"])
        out.append(rec)
    return out

