"""Readers for real LLM-serving traces, all into one table.

`read_trace(path)` returns a TraceTable with columns (numpy arrays, in file order)
  arrival_s   float seconds from the earliest row (NaN for `lengths` files, which have no times)
  prompt_len  int >= 1
  output_len  int >= 1
  hash_ids    list[int] (Mooncake: ids of the prompt's 512-token blocks) or None, per row
`table.to_frame()` gives a pandas DataFrame. Parsing uses the csv and json modules and numpy
(no pandas import: it costs more than reading a 20k-row trace).

Formats (`fmt="auto"` picks one from the extension and the CSV header):
  azure     Azure LLM inference CSV: TIMESTAMP (wall-clock string), ContextTokens, GeneratedTokens
  vidur     Vidur/Splitwise CSV: arrived_at (seconds), num_prefill_tokens, num_decode_tokens
  mooncake  Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids
  lengths   Vidur processed lengths CSV (e.g. arXiv summarisation): num_prefill_tokens,
            num_decode_tokens, no timestamps
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

FORMATS = ("azure", "vidur", "mooncake", "lengths")
MOONCAKE_BLOCK = 512  # tokens per Mooncake hash block

_CSV_COLUMNS = {  # format -> (time column or None, prompt column, output column)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "lengths": (None, "num_prefill_tokens", "num_decode_tokens"),
}
COLUMNS = ("arrival_s", "prompt_len", "output_len", "hash_ids")


class TraceFormatError(ValueError):
    """The file is not in the format asked for (or no format could be detected)."""


class TraceTable:
    """Columns of a trace; `table["prompt_len"]` etc. are numpy arrays (hash_ids: a list)."""

    __slots__ = COLUMNS

    def __init__(self, arrival_s, prompt_len, output_len, hash_ids) -> None:
        self.arrival_s = np.asarray(arrival_s, dtype=np.float64)
        self.prompt_len = np.asarray(prompt_len, dtype=np.int64)
        self.output_len = np.asarray(output_len, dtype=np.int64)
        self.hash_ids = list(hash_ids)

    def __len__(self) -> int:
        return len(self.prompt_len)

    def __getitem__(self, column: str):
        if column not in COLUMNS:
            raise KeyError(column)
        return getattr(self, column)

    @property
    def timed(self) -> bool:
        return len(self) > 0 and not np.isnan(self.arrival_s).any()

    def take(self, rows) -> "TraceTable":
        """Rows by position (a slice or an index array), as a new table."""
        if isinstance(rows, slice):
            return TraceTable(self.arrival_s[rows], self.prompt_len[rows], self.output_len[rows],
                              self.hash_ids[rows])
        rows = np.asarray(rows, dtype=np.int64)
        return TraceTable(self.arrival_s[rows], self.prompt_len[rows], self.output_len[rows],
                          [self.hash_ids[i] for i in rows.tolist()])

    def to_frame(self):
        import pandas as pd
        return pd.DataFrame({"arrival_s": self.arrival_s, "prompt_len": self.prompt_len,
                             "output_len": self.output_len,
                             "hash_ids": pd.Series(self.hash_ids, dtype=object)})


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


def read_trace(path: str | Path, fmt: str = "auto") -> TraceTable:
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
    return TraceTable(arrival, _lengths(path, prompt), _lengths(path, output), hashes)


def _numbers(path: Path, values: list, what: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64)
    except (ValueError, TypeError):
        for row, v in enumerate(values):
            try:
                float(v)
            except (ValueError, TypeError):
                raise TraceFormatError(f"{path}: row {row}: {what} {v!r} is not a number") from None
        raise


def _lengths(path: Path, values) -> np.ndarray:
    x = _numbers(path, values, "token count")
    if np.isnan(x).any():
        row = int(np.flatnonzero(np.isnan(x))[0])
        raise TraceFormatError(f"{path}: row {row}: token count {values[row]!r} is not a number")
    return np.maximum(x, 1).astype(np.int64)  # clamp: every prompt and output has >= 1 token


def _read_csv(path: Path, fmt: str):
    time_col, prompt_col, output_col = _CSV_COLUMNS[fmt]
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.reader(f, skipinitialspace=True)
        header = [h.strip() for h in next(rows, [])]
        missing = [c for c in (time_col, prompt_col, output_col) if c is not None and c not in header]
        if missing:
            raise TraceFormatError(f"{path}: not in the {fmt} format (missing columns {missing}; "
                                   f"header {header})")
        ip, io = header.index(prompt_col), header.index(output_col)
        it = header.index(time_col) if time_col is not None else None
        prompt, output, times = [], [], []
        for r in rows:
            if not r:
                continue
            prompt.append(r[ip])
            output.append(r[io])
            if it is not None:
                times.append(r[it])
    if time_col is None:
        arrival = np.full(len(prompt), np.nan)
    elif fmt == "azure":
        try:  # '2023-11-16 18:15:46.6805900': numpy parses ISO 8601 with any precision
            ts = np.array([t.strip() for t in times], dtype="datetime64[ns]")
        except ValueError as e:
            raise TraceFormatError(f"{path}: bad TIMESTAMP ({e})") from e
        arrival = (ts - ts.min()).astype(np.int64) / 1e9
    else:
        t = _numbers(path, times, time_col)
        if np.isnan(t).any():
            raise TraceFormatError(f"{path}: {time_col} has missing or non-numeric values")
        arrival = t - t.min()
    return arrival, prompt, output


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
