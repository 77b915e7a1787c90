"""Where the engine keeps what it builds or converts once (converted models, compiled kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$SERVETWIN_CACHE_DIR, else $XDG_CACHE_HOME/servetwin, else ~/.cache/servetwin."""
    if os.environ.get("SERVETWIN_CACHE_DIR"):
        return Path(os.environ["SERVETWIN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "servetwin"
