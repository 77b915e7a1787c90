"""Readers for real LLM-serving traces, all into one table.

`read_trace(path)` returns a DataFrame with columns
  arrival_s   float seconds from the earliest row (NaN for `lengths` files, which have no times)
  prompt_len  int >= 1
  output_len  int >= 1
  hash_ids    list[int] (Mooncake: ids of the prompt's 512-token blocks) or None
in file order.

Formats (`fmt="auto"` picks one from the extension and the CSV header):
  azure     Azure LLM inference CSV: TIMESTAMP (wall-clock string), ContextTokens, GeneratedTokens
  vidur     Vidur/Splitwise CSV: arrived_at (seconds), num_prefill_tokens, num_decode_tokens
  mooncake  Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids
  lengths   Vidur processed lengths CSV (e.g. arXiv summarisation): num_prefill_tokens,
            num_decode_tokens, no timestamps
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

FORMATS = ("azure", "vidur", "mooncake", "lengths")
MOONCAKE_BLOCK = 512  # tokens per Mooncake hash block

_CSV_COLUMNS = {  # format -> (time column or None, prompt column, output column)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "lengths": (None, "num_prefill_tokens", "num_decode_tokens"),
}
_AZURE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"  # e.g. 2023-11-16 18:15:46.6805900


class TraceFormatError(ValueError):
    """The file is not in the format asked for (or no format could be detected)."""


def detect_format(path: str | Path) -> str:
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        return "mooncake"
    with open(path, encoding="utf-8") as f:
        header = {c.strip() for c in f.readline().split(",")}
    if "TIMESTAMP" in header:
        return "azure"
    if "arrived_at" in header:
        return "vidur"
    if "num_prefill_tokens" in header:
        return "lengths"
    raise TraceFormatError(f"{path}: cannot detect the trace format from header {sorted(header)}; "
                           f"pass one of {FORMATS}")


def read_trace(path: str | Path, fmt: str = "auto") -> pd.DataFrame:
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; expected auto or one of {FORMATS}")
    if fmt == "mooncake":
        arrival, prompt, output, hashes = _read_mooncake(path)
    else:
        arrival, prompt, output = _read_csv(path, fmt)
        hashes = [None] * len(prompt)
    if len(prompt) == 0:
        raise TraceFormatError(f"{path}: trace has no rows")
    return pd.DataFrame({
        "arrival_s": arrival,
        "prompt_len": _lengths(path, prompt),
        "output_len": _lengths(path, output),
        "hash_ids": pd.Series(hashes, dtype=object),
    })


def _lengths(path: Path, values) -> np.ndarray:
    x = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=np.float64)
    if np.isnan(x).any():
        row = int(np.flatnonzero(np.isnan(x))[0])
        raise TraceFormatError(f"{path}: row {row}: token count {values[row]!r} is not a number")
    return np.maximum(x, 1).astype(np.int64)  # clamp: every prompt and output has >= 1 token


def _read_csv(path: Path, fmt: str):
    time_col, prompt_col, output_col = _CSV_COLUMNS[fmt]
    wanted = [c for c in (time_col, prompt_col, output_col) if c is not None]
    try:
        df = pd.read_csv(path, usecols=wanted, skipinitialspace=True)
    except ValueError as e:  # pandas names the missing columns
        raise TraceFormatError(f"{path}: not in the {fmt} format ({e})") from e
    if time_col is None:
        arrival = np.full(len(df), np.nan)
    elif fmt == "azure":
        try:
            ts = pd.to_datetime(df[time_col], format=_AZURE_TIME_FORMAT)
        except ValueError:  # other precisions or ISO variants: slower, but still right
            try:
                ts = pd.to_datetime(df[time_col], format="mixed")
            except ValueError as e:
                raise TraceFormatError(f"{path}: bad TIMESTAMP ({e})") from e
        arrival = (ts - ts.min()).dt.total_seconds().to_numpy(dtype=np.float64)
    else:
        t = pd.to_numeric(df[time_col], errors="coerce").to_numpy(dtype=np.float64)
        if np.isnan(t).any():
            raise TraceFormatError(f"{path}: {time_col} has missing or non-numeric values")
        arrival = t - t.min()
    return arrival, df[prompt_col].to_numpy(), df[output_col].to_numpy()


def _read_mooncake(path: Path):
    ts, prompt, output, hashes = [], [], [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts.append(row["timestamp"])
                prompt.append(row["input_length"])
                output.append(row["output_length"])
            except (ValueError, KeyError, TypeError) as e:
                raise TraceFormatError(f"{path}:{lineno}: not a Mooncake row ({e!r})") from e
            hashes.append([int(h) for h in row.get("hash_ids") or ()])
    t = np.asarray(ts, dtype=np.float64) / 1000.0  # ms -> s
    return (t - t.min() if len(t) else t), prompt, output, hashes
