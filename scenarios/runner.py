"""Running many simulation tasks: in local processes, inline, or on a Ray cluster, with a progress
bar and a cache of results under a hash of their inputs.

A task is a pure function named by its dotted path ("scenarios.search:probe_task") applied to a
JSON-able mapping: local processes and Ray give the same numbers, and a cached result is served
only to the same task made by the same code and data (`code_digest`).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
from pathlib import Path

CACHE_VERSION = 2


def run_task(kind: str, task: dict) -> dict:
    """Apply the function `kind` ("module:function") to `task`."""
    module, name = kind.split(":")
    return getattr(importlib.import_module(module), name)(task)


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of everything a cached simulation's result depends on besides its task: the
    simulator, scheduler and scenario code, the shipped profiles and the kernel tables. A cache
    entry made by other code or data is never served."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pattern in ("sim/*.py", "engine/core/*.py", "scenarios/*.py", "sim/profiles/*.json",
                    "calibration/kernels/*.json"):
        for p in sorted(root.glob(pattern)):
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_key(kind: str, task: dict) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "code": code_digest(), "kind": kind, "task": task},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class Runner:
    """Runs tasks in local processes (workers > 1), inline (workers == 1) or on Ray, with a
    progress bar (tqdm shows the time left) and a per-task cache."""

    def __init__(self, cache_dir: Path | None, workers: int = 2, ray_address: str | None = None,
                 progress: bool = True) -> None:
        self.cache_dir = cache_dir
        self.workers = max(1, workers)
        self.ray_address = ray_address
        self.progress = progress
        self.simulated = 0
        self.cached = 0
        self.simulated_by_kind: dict[str, int] = {}
        self._ray_started = False
        self._pool = None

    def run(self, kind: str, tasks: list[dict], desc: str, order: list[int] | None = None) -> list[dict]:
        """Results in the order of `tasks`; `order` is the order to start them in."""
        results: list = [None] * len(tasks)
        todo = []
        for i, t in enumerate(tasks):
            hit = self._load(kind, t)
            if hit is not None:
                results[i] = hit
                self.cached += 1
            else:
                todo.append(i)
        if order is not None:
            rank = {i: k for k, i in enumerate(order)}
            todo.sort(key=rank.__getitem__)
        if not todo:
            return results
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread in the parent when the worker pool forks
        bar = tqdm(total=len(todo), desc=desc, unit="run", disable=not self.progress, file=sys.stderr,
                   mininterval=0.5, leave=False)
        short = kind.split(":")[-1]
        for i, r in self._execute(kind, [tasks[i] for i in todo], todo):
            results[i] = r
            self._store(kind, tasks[i], r)
            self.simulated += 1
            self.simulated_by_kind[short] = self.simulated_by_kind.get(short, 0) + 1
            bar.update(1)
        bar.close()
        return results

    def _execute(self, kind, tasks, idx):
        if self.ray_address is not None:
            yield from self._ray(kind, tasks, idx)
        elif self.workers == 1 or len(tasks) == 1:
            for i, t in zip(idx, tasks):
                yield i, run_task(kind, t)
        else:
            from concurrent.futures import as_completed
            ex = self._executor()
            futs = {ex.submit(run_task, kind, t): i for i, t in zip(idx, tasks)}
            for f in as_completed(futs):
                yield futs[f], f.result()

    def _executor(self):
        """One process pool for the runner's life (a plan submits many small rounds)."""
        if self._pool is None:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx)
        return self._pool

    def _ray(self, kind, tasks, idx):
        import ray
        if not ray.is_initialized():
            if self.ray_address in ("", "local"):
                ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=self.ray_address, log_to_driver=False)
            self._ray_started = True
        remote = ray.remote(num_cpus=1)(run_task)
        refs = {remote.remote(kind, t): i for i, t in zip(idx, tasks)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield refs[ref], ray.get(ref)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._ray_started:
            import ray
            ray.shutdown()

    def _path(self, kind, task) -> Path | None:
        task = {k: v for k, v in task.items() if k != "memo"}  # where runs are shared is not an input
        return (None if self.cache_dir is None else
                self.cache_dir / f"{kind.split(':')[-1]}-{cache_key(kind, task)}.json")

    def _load(self, kind, task):
        p = self._path(kind, task)
        if p is None or not p.exists():
            return None
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    def _store(self, kind, task, result) -> None:
        p = self._path(kind, task)
        if p is None:
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, default=float))
        os.replace(tmp, p)


__all__ = ["Runner", "run_task", "code_digest", "cache_key"]
