"""The optional compiled build of the scheduler's hot modules (mypyc), and the switch to it.

The pure-Python modules in engine/core are the reference. `make compiled` (that is,
`python -c "from engine.core.compiled import build; build()"`) compiles MODULES with mypyc into
build/compiled/, next to a digest of the package's sources and the Python version (the mypy
version, pinned in pyproject.toml's `compiled` extra, only decides how the build is made). On import, engine.core puts build/compiled/ ahead of its own directory on the package
path, so those modules load compiled, only when:

  - SERVETWIN_PURE_PYTHON is unset (or "0"): set it to run the reference;
  - the build exists and its digest matches the sources as they are now. A stale build (a source
    edited since) is ignored with a warning: it never runs code that differs from the source.

SERVETWIN_REQUIRE_COMPILED=1 turns "not compiled" into an ImportError that says why (the test run
of the parity suite on the compiled build uses it, so it cannot silently test Python twice).

The compiled modules behave as the Python ones (the parity and fast-vs-plain tests run on both),
except that their classes are native: their instances take no attributes beyond those declared,
and their methods cannot be monkeypatched.
"""
from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

CORE_DIR = Path(__file__).resolve().parent
ROOT = CORE_DIR.parents[1]
BUILD_DIR = ROOT / "build" / "compiled"
STAMP = BUILD_DIR / "sources.sha256"
MODULES = ("block_pool", "kv_cache_manager", "scheduler", "fast_forward", "request", "features", "output")
# mypy cannot see the narrowing the hot loops do by hand (`v.__class__ is KVCacheBlock`, sentinels,
# a request known present): these checks are off for the build. mypyc still checks every declared
# type at run time, so a wrong value raises TypeError instead of passing silently.
MYPY_FLAGS = ("--disable-error-code=union-attr", "--disable-error-code=arg-type",
              "--disable-error-code=return-value", "--disable-error-code=index",
              "--disable-error-code=var-annotated", "--disable-error-code=assignment",
              "--disable-error-code=attr-defined", "--disable-error-code=operator",
              "--disable-error-code=misc", "--disable-error-code=call-overload",
              "--ignore-missing-imports", "--follow-imports=silent")

ACTIVE = False
STATUS = "pure Python (not activated)"


def sources_digest() -> str:
    h = hashlib.sha256()
    h.update(f"{sys.implementation.cache_tag}\n".encode())
    # Every source of the package, not only MODULES: the compiled code relies on the types of
    # what it imports from the others (config, policy, records, ...).
    for p in sorted(CORE_DIR.glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def build_name() -> str:
    """"compiled" or "pure": which engine.core this process runs (recorded in summaries)."""
    return "compiled" if ACTIVE else "pure"


def activate(package_path: list[str]) -> None:
    """Called by engine/core/__init__.py before it imports any submodule."""
    global ACTIVE, STATUS
    if os.environ.get("SERVETWIN_PURE_PYTHON", "0") not in ("", "0"):
        STATUS = "pure Python (SERVETWIN_PURE_PYTHON is set)"
    elif not STAMP.exists():
        STATUS = f"pure Python (no compiled build in {BUILD_DIR}; `make compiled` builds it)"
    elif STAMP.read_text().strip() != sources_digest():
        STATUS = (f"pure Python (the compiled build in {BUILD_DIR} is stale: engine/core sources or "
                  "Python changed since; `make compiled` rebuilds it)")
        warnings.warn(f"engine.core: {STATUS}", stacklevel=3)
    else:
        package_path.insert(0, str(BUILD_DIR / "engine" / "core"))
        if str(BUILD_DIR) not in sys.path:
            sys.path.append(str(BUILD_DIR))  # mypyc's shared runtime module lives at its top
        ACTIVE, STATUS = True, f"compiled (mypyc, {BUILD_DIR})"
    if not ACTIVE and os.environ.get("SERVETWIN_REQUIRE_COMPILED", "0") not in ("", "0"):
        raise ImportError(f"SERVETWIN_REQUIRE_COMPILED is set but engine.core runs {STATUS}")


def build() -> Path:
    """Compile MODULES into BUILD_DIR with mypyc (needs mypy and a C compiler)."""
    import importlib
    import shutil
    import tempfile

    # Imported by name: mypy, compiling engine.core, must not follow these into mypy itself.
    mypycify = importlib.import_module("mypyc.build").mypycify
    setup = importlib.import_module("setuptools").setup

    paths = [str(Path("engine") / "core" / f"{m}.py") for m in MODULES]
    cwd = os.getcwd()
    tmp = Path(tempfile.mkdtemp(prefix="servetwin-mypyc-"))
    # A copy of the package in a scratch directory: mypyc names modules by their path from the
    # working directory (engine/core/x.py -> engine.core.x), and setuptools must not read the
    # project's own pyproject.toml.
    shutil.copytree(CORE_DIR, tmp / "engine" / "core", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(CORE_DIR.parent / "__init__.py", tmp / "engine" / "__init__.py")
    os.chdir(tmp)
    try:
        if BUILD_DIR.exists():
            shutil.rmtree(BUILD_DIR)
        exts = mypycify([*MYPY_FLAGS, *paths], opt_level="3", target_dir="c")
        setup(name="servetwin-compiled", ext_modules=exts,
              script_args=["-q", "build_ext", "--build-lib", str(BUILD_DIR), "--build-temp", "o"])
    finally:
        os.chdir(cwd)
        shutil.rmtree(tmp, ignore_errors=True)
    STAMP.write_text(sources_digest() + "\n")
    return BUILD_DIR

