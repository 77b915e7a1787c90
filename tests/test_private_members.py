"""Nothing outside the scheduler's own modules touches their private members.

The scheduler, the KV cache manager and the block pool keep invariants between their private
members (a fast path that reached into them once carried its own copies of their logic). This
scans every Python file of the repository for an attribute access `x._name` (or
getattr(x, "_name")) where `_name` is a private member defined in one of those modules' classes,
outside the module that defines it.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWNERS = ["engine/core/scheduler.py", "engine/core/fast_forward.py", "engine/core/kv_cache_manager.py", "engine/core/block_pool.py"]
SKIP_DIRS = {".venv", ".git", "build", "dist", "node_modules", "__pycache__"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_members(path: Path) -> set[str]:
    """Private methods, class attributes and `self._x` attributes of the classes in a module."""
    names: set[str] = set()
    for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and _is_private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _is_private(node.id):
                names.add(node.id)  # class-level attribute
        for stmt in cls.body:  # __slots__ = ("_a", ...)
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                    for t in stmt.targets):
                for c in ast.walk(stmt.value):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and _is_private(c.value):
                        names.add(c.value)
    return names


def accesses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every attribute access to one of `names` in the source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
            found.append((node.lineno, node.args[1].value))
    return found


def python_files():
    for p in ROOT.rglob("*.py"):
        if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts):
            yield p


def test_owner_modules_define_private_members():
    # The scan below is only as good as this list; these must be found.
    owned = {o: private_members(ROOT / o) for o in OWNERS}
    assert {"_free_request", "_preempt"} <= owned["engine/core/scheduler.py"]
    assert {"_lazy", "_fast_step", "_can_go_lazy"} <= owned["engine/core/fast_forward.py"]
    assert {"_cache_full_blocks", "_ensure_block_hashes"} <= owned["engine/core/kv_cache_manager.py"]


def test_scan_flags_a_violation():
    names = {"_preempt", "_cache_full_blocks"}
    src = "def f(s):\n    s._preempt(1)\n    return getattr(s.kvm, '_cache_full_blocks')\n"
    assert sorted(accesses(src, names)) == [(2, "_preempt"), (3, "_cache_full_blocks")]
    assert accesses("def f(s):\n    return s.admit(1)\n", names) == []


def test_no_private_member_access_outside_the_owning_module():
    owner_of: dict[str, set[str]] = {}
    for o in OWNERS:
        for name in private_members(ROOT / o):
            owner_of.setdefault(name, set()).add(o)
    bad = []
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, name in accesses(path.read_text(), set(owner_of)):
            if rel not in owner_of[name]:
                bad.append(f"{rel}:{line}: {name} (private to {', '.join(sorted(owner_of[name]))})")
    assert not bad, "private members used outside their module:\n" + "\n".join(bad)
