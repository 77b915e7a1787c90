"""The compiled CPU decode-attention kernel (paged_decode_cpu.cpp): built on first use, cached.

`load()` returns the op namespace the library registers (`torch.ops.servetwin`, whose
`paged_decode` the CPU backend calls), or None when it cannot be had: the torch path in
`engine.attention.cpu` is then used, with one warning saying why. Set `SERVETWIN_CPU_KERNEL=0` to
use the torch path on purpose (to compare the two, or on a machine without a C++ compiler).

The build (torch.utils.cpp_extension with ninja, a few tens of seconds once) goes to
`<cache_dir>/cpu_kernel/<key>`, where the key covers the source, the flags, torch's version and
the Python ABI, so a changed source or a new torch rebuilds instead of loading a stale library.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
ENV = "SERVETWIN_CPU_KERNEL"

_module: Any = None  # torch.ops.servetwin once built
_tried = False


def _cflags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu = ""
    if " avx2" in cpu and " fma" in cpu:
        flags += ["-mavx2", "-mfma"]
    if " avx512f" in cpu:
        flags += ["-mavx512f"]
    return flags


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH: add the pip package's binary (a venv not activated has its
    bin directory off PATH)."""
    try:
        import ninja

        where = getattr(ninja, "BIN_DIR", None)
    except ImportError:
        where = None
    where = where or str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if where not in path.split(os.pathsep):
        os.environ["PATH"] = where + os.pathsep + path


def load() -> Any:
    """`torch.ops.servetwin` with the kernel loaded, or None (torch fallback); tries once per process."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get(ENV, "1").strip() == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as build

        from engine.paths import cache_dir

        _ninja_on_path()
        flags = _cflags()
        # torch's install directory too: two virtual environments write different include paths
        # into build.ninja, and sharing one build directory made each rebuild the other's
        key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(flags).encode(), torch.__version__.encode(),
                                         sys.implementation.cache_tag.encode(),
                                         os.path.dirname(torch.__file__).encode()])).hexdigest()[:16]
        out = cache_dir() / "cpu_kernel" / key
        out.mkdir(parents=True, exist_ok=True)
        # torch's build lock is a file that waits forever when its holder died mid-build (a killed
        # test run left one and every later engine hung in its first forward). An OS lock, which
        # dies with its holder, serialises the builders; under it a leftover torch lock is stale.
        with open(out / "servetwin-build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (out / "lock").unlink(missing_ok=True)
            build(name=f"servetwin_paged_decode_{key}", sources=[str(SOURCE)], extra_cflags=flags,
                  extra_ldflags=["-fopenmp"], build_directory=str(out), is_python_module=False, verbose=False)
        _module = torch.ops.servetwin
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        warnings.warn(f"CPU decode-attention kernel unavailable, using the torch path ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else e!r}); set {ENV}=0 to silence this",
                      RuntimeWarning, stacklevel=2)
        _module = None
    return _module


if __name__ == "__main__":  # build now (make test does), instead of in the first forward
    import time

    t = time.perf_counter()
    if load() is None:
        raise SystemExit("the CPU decode-attention kernel did not build (see the warning above)")
    print(f"CPU decode-attention kernel ready ({time.perf_counter() - t:.1f} s)")
