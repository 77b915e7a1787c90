"""Typed reading of one YAML mapping with errors that name the key path and the value.

Read keys with the typed getters; `done()` then rejects any key that was not read (unknown key).
Workload and scenario validation both use it.
"""
from __future__ import annotations

import math
import numbers

MISSING = object()


class SpecError(ValueError):
    """Invalid spec; the message names the key path and the offending value."""


class SpecMap:
    error: type[SpecError] = SpecError

    def __init__(self, value, path: str) -> None:
        if not isinstance(value, dict):
            raise self.error(f"{path}={value!r}: must be a mapping")
        self.d, self.path, self.read = value, path, set()

    def _get(self, key, default):
        self.read.add(key)
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is MISSING:
            raise self.error(f"{self.path}.{key}: required")
        return default

    def _bad(self, key, value, why: str) -> SpecError:
        return self.error(f"{self.path}.{key}={value!r}: {why}")

    def has(self, key) -> bool:
        return self.d.get(key) is not None

    def integer(self, key, default=MISSING, ge=None, le=None):
        v = self._get(key, default)
        if v is default and default is not MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise self._bad(key, v, "must be an integer")
        return self._range(key, int(v), ge=ge, le=le)

    def number(self, key, default=MISSING, gt=None, ge=None, le=None):
        v = self._get(key, default)
        if v is default and default is not MISSING:
            return v
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise self._bad(key, v, "must be a finite number")
        return float(self._range(key, v, gt=gt, ge=ge, le=le))

    def boolean(self, key, default=MISSING):
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, v, "must be true or false")
        return v

    def text(self, key, default=MISSING, choices=None):
        v = self._get(key, default)
        if v is default and default is not MISSING and v is None:
            return v
        if not isinstance(v, str):
            raise self._bad(key, v, "must be a string")
        if choices is not None and v not in choices:
            raise self._bad(key, v, f"must be one of {', '.join(choices)}")
        return v

    def raw(self, key, default=MISSING):
        return self._get(key, default)

    def sub(self, key) -> "SpecMap | None":
        self.read.add(key)
        return type(self)(self.d[key], f"{self.path}.{key}") if self.has(key) else None

    def _range(self, key, v, gt=None, ge=None, le=None):
        if gt is not None and not v > gt:
            raise self._bad(key, v, f"must be > {gt}")
        if ge is not None and not v >= ge:
            raise self._bad(key, v, f"must be >= {ge}")
        if le is not None and not v <= le:
            raise self._bad(key, v, f"must be <= {le}")
        return v

    def done(self, allowed=()) -> None:
        """Reject keys not read (nor in `allowed`, for checking a mapping before reading it)."""
        self.read.update(allowed)
        extra = [k for k in self.d if k not in self.read]
        if extra:
            k = extra[0]
            raise self.error(f"{self.path}.{k}={self.d[k]!r}: unknown key; expected one of "
                             f"{', '.join(sorted(map(str, self.read)))}")
