"""The switch between engine.core's pure-Python reference and its optional compiled build.

The parity and fast-vs-plain suites themselves run on both builds (`make test`); these tests
check the rules that decide which one loads.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from engine.core import compiled


@pytest.fixture()
def fake_build(tmp_path, monkeypatch):
    """A build directory of our own, so the tests never touch the real build/compiled."""
    monkeypatch.setattr(compiled, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(compiled, "STAMP", tmp_path / "sources.sha256")
    monkeypatch.setattr(compiled, "ACTIVE", False)
    monkeypatch.delenv("SERVETWIN_PURE_PYTHON", raising=False)
    monkeypatch.delenv("SERVETWIN_REQUIRE_COMPILED", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path


def test_no_build_means_pure_python(fake_build):
    path = ["/src/engine/core"]
    compiled.activate(path)
    assert path == ["/src/engine/core"] and not compiled.ACTIVE
    assert "make compiled" in compiled.STATUS


def test_a_matching_build_goes_first_on_the_package_path(fake_build):
    (fake_build / "sources.sha256").write_text(compiled.sources_digest() + "\n")
    path = ["/src/engine/core"]
    compiled.activate(path)
    assert path == [str(fake_build / "engine" / "core"), "/src/engine/core"]
    assert compiled.ACTIVE and str(fake_build) in sys.path


def test_a_stale_build_is_ignored_with_a_warning(fake_build):
    (fake_build / "sources.sha256").write_text("0" * 64 + "\n")  # built from other sources
    path = ["/src/engine/core"]
    with pytest.warns(UserWarning, match="stale"):
        compiled.activate(path)
    assert path == ["/src/engine/core"] and not compiled.ACTIVE


def test_pure_python_switch_wins_over_a_build(fake_build, monkeypatch):
    (fake_build / "sources.sha256").write_text(compiled.sources_digest() + "\n")
    monkeypatch.setenv("SERVETWIN_PURE_PYTHON", "1")
    path = ["/src/engine/core"]
    compiled.activate(path)
    assert path == ["/src/engine/core"] and "SERVETWIN_PURE_PYTHON" in compiled.STATUS


def test_require_compiled_refuses_pure_python(fake_build, monkeypatch):
    monkeypatch.setenv("SERVETWIN_REQUIRE_COMPILED", "1")
    with pytest.raises(ImportError, match="SERVETWIN_REQUIRE_COMPILED"):
        compiled.activate(["/src/engine/core"])


def test_digest_follows_every_source_of_the_package(tmp_path, monkeypatch):
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(compiled, "CORE_DIR", tmp_path)
    before = compiled.sources_digest()
    (tmp_path / "b.py").write_text("x = 2\n")  # not a compiled module: still changes the digest
    assert compiled.sources_digest() != before


def test_loaded_modules_match_the_switch():
    """In this process, the hot modules come from the compiled build exactly when it is active."""
    for m in compiled.MODULES:
        mod = importlib.import_module(f"engine.core.{m}")
        assert mod.__file__.endswith(".so") == compiled.ACTIVE, (m, mod.__file__, compiled.STATUS)


def test_a_fresh_process_reports_its_build():
    """`SERVETWIN_PURE_PYTHON=1` gives the reference in a new process, whatever is built."""
    code = ("import engine.core.scheduler as s, engine.core.compiled as c; "
            "print(c.ACTIVE, s.__file__.endswith('.so'))")
    with warnings.catch_warnings():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"SERVETWIN_PURE_PYTHON": "1", "PATH": ""}).stdout.split()
    assert out == ["False", "False"]
