"""Run vLLM's own `tests/entrypoints/openai` test modules, unchanged, against `servetwin serve`.

    python bench/vllm_entrypoint_tests.py [--workdir DIR] [--venv DIR] [--vllm-version 0.34.0]
                                          [--modules M ...] [--timeout S] [--servetwin PATH]

Run it with the interpreter of the venv servetwin is installed in (e.g. .venv/bin/python): that
venv's `servetwin` executable is the server under test, and its loader gives the default model.

What it does:
  1. fetches the vLLM sdist of --vllm-version from PyPI (JSON API) into WORKDIR unless it is there
     (its sha256 checked), and extracts its tests/, vllm/ and examples/ into WORKDIR/src, unchanged;
  2. creates the test venv (WORKDIR/venv) unless --venv names an existing one: `python -m venv`,
     `pip install torch==2.13.0` first (the pin takes a CPU wheel; an unpinned torch pulls GBs of
     CUDA wheels), then bench/vllm_entrypoints/requirements.txt (pinned pytest, openai, schemathesis,
     transformers, ... as vLLM's requirements/test/cpu.txt);
  3. writes WORKDIR/bin/vllm from bench/vllm_entrypoints/vllm_shim.sh: vLLM's RemoteOpenAIServer
     starts `vllm serve MODEL ARGS`, which becomes `servetwin serve --model default
     --served-model-name MODEL --device cpu ARGS` (the servetwin beside this interpreter unless
     --servetwin is given), every vLLM flag passed through, so one servetwin refuses fails its module;
  4. runs each selected module with pytest in WORKDIR/src, one module at a time, with the plugin
     bench/vllm_entrypoints/servetwin_plugin.py (no hub downloads; the test model's tokenizer, config,
     files and the tests' own reference model (HfRunner, e.g. the embeddings the prompt-embeds tests
     send) are servetwin's default model's local folder, found with
     engine.model.loader.resolve_model; LoRA adapter downloads are empty folders), a per-test timeout
     (--timeout, raised per module by the selection) and a junit XML per module; afterwards it kills
     any `servetwin serve` process the module left running (only processes this run started);
  5. prints JSON to stdout: the vLLM version, per test {nodeid, outcome, message (first line of the
     failure), excluded}, totals (passed / failed / error / skipped) over the selected tests, the same
     for the tests of run modules that are outside the selection, per-module totals (with pytest's
     exit status and seconds) and the wall time. Progress goes to stderr; per-module pytest output
     (server logs included) to WORKDIR/logs/<module>.log, every server command line to
     WORKDIR/logs/shim.log.

The selection (bench/vllm_entrypoints/selection.txt, each exclusion with its reason): the modules
whose tests talk to a server started by vLLM's RemoteOpenAIServer. Left out, as whole modules or as
tests inside a run module: the Responses API, multimodal input, tools / tool-call parsers, LoRA,
structured output / guided decoding, embeddings / pooling, unit tests that start no server (protocol
objects, mocked engines, renderers), and tests that need the HF hub (lm-eval, tensorizer). Tests of a
run module that are outside the selection still run (the module runs whole, as in vLLM's CI); they
are reported as "excluded", with the reason, outside the totals. Modules of the sdist that the
selection does not name (a newer vLLM) are listed under "unlisted_modules" and not run.

Reading the result: the tests use vLLM's test models (Qwen, Zephyr, ...) while servetwin serves its
default model (SmolLM2-135M-Instruct) under their names, so some failures are the model's (an exact
expected answer, a generation without max_tokens that outlasts the test's timeout, another
tokenizer's vocabulary) and others are the server's (a refused flag, a missing field, a 4xx/5xx).
The JSON does not classify them: read each failure per test (its message, WORKDIR/logs/<module>.log).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import urljoin

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "vllm_entrypoints"
TESTS = "tests/entrypoints/openai"
SDIST_DIRS = ("tests", "vllm", "examples")
TORCH_PIN = "torch==2.13.0"
PYPI = "https://pypi.org/pypi"
OUTCOMES = ("passed", "failed", "error", "skipped")
RUN_MARK = "SERVETWIN_BENCH_RUN"  # in the environment of every process this run starts


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- 1. sdist
def _sdist_entry(version: str) -> tuple[str, str, str]:
    """(url, filename, sha256) of vllm==version's sdist, from PyPI's JSON API."""
    tries = [(f"{PYPI}/vllm/{version}/json", None), (f"{PYPI}/vllm/json", version)]
    last: Exception | None = None
    for url, release in tries:
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                meta = json.load(resp)
        except urllib.error.HTTPError as e:  # some mirrors serve only the project-level document
            last = e
            continue
        files = meta["urls"] if release is None else meta.get("releases", {}).get(release, [])
        for f in files:
            if f.get("packagetype") == "sdist":
                return urljoin(url, f["url"]), f["filename"], f["digests"]["sha256"]
        last = RuntimeError(f"{url}: no sdist for vllm {version}")
    raise RuntimeError(f"vllm {version}: sdist not found on PyPI ({last})")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(version: str, workdir: Path) -> Path:
    have = workdir / f"vllm-{version}.tar.gz"
    if have.is_file():
        return have
    url, filename, sha = _sdist_entry(version)
    log(f"fetching {url}")
    tmp = workdir / f".{filename}.part"
    with urllib.request.urlopen(url, timeout=300) as resp, open(tmp, "wb") as out:
        shutil.copyfileobj(resp, out, 1 << 20)
    if _sha256(tmp) != sha:
        tmp.unlink()
        raise RuntimeError(f"{url}: sha256 mismatch")
    tmp.rename(have)
    return have


def extract(sdist: Path, src: Path, version: str) -> None:
    """tests/, vllm/, examples/ of the sdist into src/, unchanged (once per version)."""
    mark = src / ".vllm-version"
    if mark.is_file() and mark.read_text().strip() == version and all((src / d).is_dir() for d in SDIST_DIRS):
        return
    log(f"extracting {', '.join(SDIST_DIRS)} of {sdist.name} into {src}")
    mark.unlink(missing_ok=True)
    for d in SDIST_DIRS:
        shutil.rmtree(src / d, ignore_errors=True)
    src.mkdir(parents=True, exist_ok=True)

    def strip(name: str) -> str | None:
        parts = name.split("/", 1)
        return parts[1] if len(parts) == 2 and parts[1].split("/", 1)[0] in SDIST_DIRS else None

    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            name = strip(m.name)
            if name is None:
                continue
            m.name = name
            if m.islnk():
                m.linkname = strip(m.linkname) or m.linkname
            members.append(m)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(src, members=members, **kwargs)
    mark.write_text(version + "\n")


# ---------------------------------------------------------------- 2. test venv
def ensure_venv(venv: Path, given: bool) -> Path:
    py = venv / "bin" / "python"
    req = HERE / "requirements.txt"
    if given and py.exists():
        return py  # --venv names an existing venv: used as it is
    stamp = venv / ".servetwin-bench-installed"
    want = _sha256(req) + " " + TORCH_PIN
    if py.exists() and stamp.is_file() and stamp.read_text().strip() == want:
        return py
    if not py.exists():
        log(f"creating the test venv {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log(f"pip install {TORCH_PIN}, then {req.name}")
    subprocess.run([str(py), "-m", "pip", "install", "-q", TORCH_PIN], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(req)], check=True)
    stamp.write_text(want + "\n")
    return py


# ---------------------------------------------------------------- 3. shim, model
def write_shim(bindir: Path, servetwin: Path, shim_log: Path) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    text = (HERE / "vllm_shim.sh").read_text()
    text = text.replace("@SERVETWIN@", shlex.quote(str(servetwin))).replace("@SHIM_LOG@", shlex.quote(str(shim_log)))
    shim = bindir / "vllm"
    shim.write_text(text)
    shim.chmod(0o755)


def default_model_dir() -> Path:
    """servetwin's default model as a local HF folder (converted and cached on first use)."""
    sys.path.insert(0, str(ROOT))
    from engine.model.loader import resolve_model

    return resolve_model("default")


# ---------------------------------------------------------------- selection
def load_selection(path: Path):
    runs: dict[str, int] = {}
    outs: list[tuple[str, str]] = []
    tests: list[tuple[str, re.Pattern, str]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        kind, rest = (line.split(None, 1) + [""])[:2]
        if kind == "run":
            parts = rest.split()
            timeout = 0
            for p in parts[1:]:
                if p.startswith("timeout="):
                    timeout = int(p.split("=", 1)[1])
            runs[parts[0]] = timeout
        elif kind == "out":
            glob, reason = (rest.split(None, 1) + [""])[:2]
            outs.append((glob, reason))
        elif kind == "test":
            spec, reason = (rest.split(None, 1) + [""])[:2]
            module, regex = spec.split("::", 1)
            tests.append((module, re.compile(regex), reason))
        else:
            raise ValueError(f"{path}:{n}: unknown kind {kind!r}")
    return runs, outs, tests


def excluded_reason(module: str, name: str, tests) -> str | None:
    for mod, regex, reason in tests:
        if mod == module and regex.match(name):
            return reason
    return None


# ---------------------------------------------------------------- 4. run
def _our_servers(token: str) -> list[int]:
    """Live `servetwin serve` processes carrying this run's mark in their environment (Linux)."""
    pids = []
    proc = Path("/proc")
    if not proc.is_dir():
        return pids
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{RUN_MARK}={token}".encode() in env and any(
                os.path.basename(a) == b"servetwin" and b == b"serve" for a, b in zip(argv, argv[1:])):
            pids.append(int(d.name))
    return pids


def kill_leftovers(token: str) -> list[int]:
    pids = _our_servers(token)
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _our_servers(token):
            time.sleep(0.2)
        if not _our_servers(token):
            break
    return pids


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def _last_error(text: str | None) -> str:
    """First line of the last block of pytest's `E   ...` lines (the exception finally raised)."""
    first, prev_e = "", False
    for line in (text or "").splitlines():
        is_e = line.startswith("E ")
        if is_e and not prev_e:
            first = line[1:].strip()[:300]
        prev_e = is_e
    return first


def parse_junit(xml: Path, module: str) -> list[dict]:
    """Per test {nodeid, outcome, message}; a module that failed to collect is one error."""
    path = f"{TESTS}/{module}"
    dotted = path[:-3].replace("/", ".")
    tests: dict[str, dict] = {}
    for tc in ET.parse(xml).iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        if cls == dotted:
            nodeid = f"{path}::{name}"
        elif cls.startswith(dotted + "."):
            nodeid = f"{path}::{cls[len(dotted) + 1:].replace('.', '::')}::{name}"
        elif not cls:  # collection error: name is the module's dotted path
            nodeid = path
        else:
            nodeid = f"{cls}::{name}"
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = _first_line(child.get("message"))
                if message in ("", "collection failure"):  # the text's own error says more
                    message = _last_error(child.text) or message or _first_line(child.text)
                break
        prev = tests.get(nodeid)
        if prev is None or (prev["outcome"] in ("passed", "skipped") and outcome in ("failed", "error")):
            tests[nodeid] = {"nodeid": nodeid, "outcome": outcome, "message": message}
    return list(tests.values())


def run_module(py: Path, src: Path, logs: Path, module: str, timeout: int, env: dict) -> tuple[int, float, Path]:
    name = module[:-3].replace("/", "_")
    xml, out = logs / f"{name}.xml", logs / f"{name}.log"
    xml.unlink(missing_ok=True)
    cmd = [str(py), "-m", "pytest", "-p", "servetwin_plugin", "-p", "no:cacheprovider", "-rA",
           "--timeout", str(timeout), "--junitxml", str(xml), f"{TESTS}/{module}"]
    start = time.monotonic()
    with open(out, "w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, cwd=src, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - start, xml


def _counts(tests: list[dict]) -> dict:
    c = {k: 0 for k in OUTCOMES}
    for t in tests:
        c[t["outcome"]] += 1
    return c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "build" / "vllm_entrypoints",
                    help="sdist, extracted sources, test venv, shim and logs (default: build/vllm_entrypoints)")
    ap.add_argument("--venv", type=Path, help="test venv: used as it is if it exists, else created there "
                    "(default: WORKDIR/venv)")
    ap.add_argument("--vllm-version", default="0.34.0")
    ap.add_argument("--modules", nargs="+", metavar="M",
                    help="modules to run, relative to tests/entrypoints/openai (default: the selection)")
    ap.add_argument("--timeout", type=int, default=120, help="per-test timeout, s (default 120; the "
                    "selection raises it for some modules)")
    ap.add_argument("--servetwin", type=Path, default=Path(sys.executable).parent / "servetwin",
                    help="the servetwin executable (default: the one beside this interpreter)")
    args = ap.parse_args(argv)

    t0 = time.monotonic()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    servetwin = args.servetwin.absolute()
    if not os.access(servetwin, os.X_OK):
        ap.error(f"{servetwin} is not an executable; run with servetwin's interpreter or pass --servetwin")

    src, logs, bindir = workdir / "src", workdir / "logs", workdir / "bin"
    logs.mkdir(exist_ok=True)
    extract(fetch_sdist(args.vllm_version, workdir), src, args.vllm_version)
    shutil.copyfile(HERE / "pytest.ini", src / "pytest.ini")
    venv = (args.venv or workdir / "venv").absolute()
    py = ensure_venv(venv, args.venv is not None)
    shim_log = logs / "shim.log"
    write_shim(bindir, servetwin, shim_log)
    model_dir = default_model_dir()

    runs, outs, excl = load_selection(HERE / "selection.txt")
    present = sorted(str(p.relative_to(src / TESTS)) for p in (src / TESTS).rglob("test_*.py"))
    unlisted = [m for m in present if m not in runs and not any(fnmatch.fnmatch(m, g) for g, _ in outs)]
    for m in unlisted:
        log(f"note: {m} is neither run nor excluded by selection.txt (not run)")
    modules = [m.removeprefix(TESTS + "/") for m in args.modules] if args.modules else list(runs)

    token = uuid.uuid4().hex
    env = dict(os.environ)
    for k in ("PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(k, None)
    env.update({
        "PATH": str(bindir) + os.pathsep + env.get("PATH", ""),
        "PYTHONPATH": str(src) + os.pathsep + str(HERE),
        "VLLM_TARGET_DEVICE": "cpu",  # no vllm package metadata: vLLM's platform detection would fail
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "SERVETWIN_BENCH_MODEL_DIR": str(model_dir),
        "SERVETWIN_BENCH_FAKE_HUB": str(workdir / "fake_hub"),
        RUN_MARK: token,
    })
    shim_log.unlink(missing_ok=True)

    all_tests: list[dict] = []
    per_module: dict[str, dict] = {}
    try:
        for i, module in enumerate(modules, 1):
            timeout = max(args.timeout, runs.get(module, 0))
            log(f"[{i}/{len(modules)}] {module} (per-test timeout {timeout}s)")
            if not (src / TESTS / module).is_file():
                tests = [{"nodeid": f"{TESTS}/{module}", "outcome": "error", "message": "no such module in the sdist"}]
                rc, secs = None, 0.0
            else:
                rc, secs, xml = run_module(py, src, logs, module, timeout, env)
                left = kill_leftovers(token)
                if left:
                    log(f"    killed leftover servetwin serve processes: {left}")
                if xml.is_file():
                    tests = parse_junit(xml, module)
                else:
                    tests = [{"nodeid": f"{TESTS}/{module}", "outcome": "error",
                              "message": f"pytest exited with status {rc} and wrote no junit XML"}]
            for t in tests:
                t["excluded"] = excluded_reason(module, t["nodeid"].split("::", 1)[1], excl) if "::" in t["nodeid"] else None
            sel = [t for t in tests if not t["excluded"]]
            per_module[module] = {**_counts(sel), "excluded": len(tests) - len(sel), "rc": rc, "seconds": round(secs, 1)}
            all_tests += tests
            c = per_module[module]
            log(f"    rc={rc} {secs:.0f}s: " + ", ".join(f"{c[k]} {k}" for k in OUTCOMES if c[k])
                + (f" (+{c['excluded']} excluded)" if c["excluded"] else ""))
    finally:
        kill_leftovers(token)

    selected = [t for t in all_tests if not t["excluded"]]
    result = {
        "vllm_version": args.vllm_version,
        "servetwin": str(servetwin),
        "model_dir": str(model_dir),
        "workdir": str(workdir),
        "totals": _counts(selected),
        "excluded_totals": _counts([t for t in all_tests if t["excluded"]]),
        "modules": per_module,
        "unlisted_modules": unlisted,
        "tests": all_tests,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
