#!/usr/bin/env python3
"""The layout rules `make test` holds the source tree to (docs/ARCHITECTURE.md):

1. No import circle among the project's own files: Rust modules of each
   crate (``use crate::``/``super::``/``self::`` and inline ``crate::a::b``
   paths; a parent module naming its own children does not count, since it
   declares them) and the Python package ``clients/python/src/kvtier``
   (``from .x``, ``from kvtier.x``, ``import kvtier.x``).
2. No source file over LINES_MAX lines in engine/, server/, s3/,
   local-proto/, client/, clients/python/native/ and clients/python/src.
3. loadgen/src/main.rs only dispatches (at most MAIN_LINES_MAX lines).

Usage: ``check_layout.py [ROOT]`` prints every breach and exits 1 if any;
``check_layout.py --self-test`` checks the checker on made-up trees.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

LINES_MAX = 600
MAIN_LINES_MAX = 150
SIZE_CHECKED = [
    "engine/src",
    "server/src",
    "s3/src",
    "local-proto/src",
    "client/src",
    "clients/python/native/src",
    "clients/python/src",
]
SKIPPED_CRATES = {"vendor", "target", "fuzz"}

Module = tuple[str, ...]


def rust_modules(src: Path) -> dict[Module, Path]:
    """Every module file of a crate's src/, by module path (`bin/` skipped)."""
    modules: dict[Module, Path] = {}
    for path in sorted(src.rglob("*.rs")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[0] == "bin":
            continue
        if parts == ["lib"] or parts == ["main"]:
            parts = []
        elif parts[-1] == "mod":
            parts = parts[:-1]
        modules[tuple(parts)] = path
    return modules


USE = re.compile(r"\buse\s+(crate|super|self)((?:::\w+)*)(?:::\{([^;]*)\})?\s*;", re.S)
INLINE = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
TESTS = re.compile(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{.*", re.S)


def rust_references(text: str) -> list[tuple[str, list[str]]]:
    """(head, path) of every module path a file names."""
    text = re.sub(r"//[^\n]*", "", text)
    text = TESTS.sub("", text)
    refs: list[tuple[str, list[str]]] = []
    for m in USE.finditer(text):
        head, prefix = m.group(1), [p for p in m.group(2).split("::") if p]
        if m.group(3) is None:
            refs.append((head, prefix))
            continue
        for item in re.findall(r"[A-Za-z_][\w:]*", m.group(3)):
            refs.append((head, prefix + [p for p in item.split("::") if p]))
    for m in INLINE.finditer(text):
        refs.append((m.group(1), [p for p in m.group(2).split("::") if p]))
    return refs


def rust_edges(src: Path) -> dict[Path, set[Path]]:
    """File → files it names, within one crate."""
    modules = rust_modules(src)
    edges: dict[Path, set[Path]] = {}
    for module, path in modules.items():
        for head, parts in rust_references(path.read_text(encoding="utf-8", errors="replace")):
            if head == "crate":
                full = parts
            elif head == "super":
                up = 1
                while parts and parts[0] == "super":
                    up, parts = up + 1, parts[1:]
                full = list(module[: max(0, len(module) - up)]) + parts
            else:
                full = list(module) + parts
            target = next((tuple(full[:n]) for n in range(len(full), -1, -1) if tuple(full[:n]) in modules), None)
            if target is None or target == module or target[: len(module)] == module:
                continue  # itself, or a parent naming its own child
            edges.setdefault(path, set()).add(modules[target])
    return edges


def python_edges(package: Path, name: str) -> dict[Path, set[Path]]:
    """File → package files it imports, subpackages included: ``from .x``,
    ``from ..a.b``, ``from . import x`` (a module of that package),
    ``from kvtier.a.b``, ``import kvtier.a.b``. A subpackage's
    ``__init__.py`` is imported by nothing here (it holds no code)."""
    files = {tuple(p.relative_to(package).with_suffix("").parts): p for p in package.rglob("*.py")}
    pattern = re.compile(
        r"^\s*(?:from\s+(?P<dots>\.+)(?P<rel>[\w.]*)\s+import\s+(?P<names>\([^)]*\)|[^\n]*)"
        r"|from\s+%s\.(?P<abs>[\w.]+)\s+import|import\s+%s\.(?P<imp>[\w.]+))" % (name, name),
        re.M,
    )
    edges: dict[Path, set[Path]] = {}
    for parts, path in files.items():
        if parts[-1] == "__init__":
            continue
        here = parts[:-1]
        for m in pattern.finditer(path.read_text(encoding="utf-8")):
            targets: list[tuple[str, ...]] = []
            if m["dots"]:
                base = here[: len(here) - (len(m["dots"]) - 1)]
                if m["rel"]:
                    targets.append(base + tuple(m["rel"].split(".")))
                else:  # from . import a, b: modules of that package
                    names = m["names"].strip("()").split(",")
                    targets += [base + (n.split(" as ")[0].strip(),) for n in names if n.strip()]
            else:
                targets.append(tuple((m["abs"] or m["imp"]).split(".")))
            for target in targets:
                if target in files and target != parts and target[-1] != "__init__":
                    edges.setdefault(path, set()).add(files[target])
    return edges


def circles(edges: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one file (Tarjan,
    iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []
    counter = 0
    nodes = set(edges) | {t for ts in edges.values() for t in ts}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def breaches(root: Path) -> list[str]:
    """Every breach of the rules under `root`, as lines to print."""
    out: list[str] = []
    edges: dict[Path, set[Path]] = {}
    for crate in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SKIPPED_CRATES):
        if (crate / "Cargo.toml").exists() and (crate / "src").is_dir():
            edges.update(rust_edges(crate / "src"))
    package = root / "clients" / "python" / "src" / "kvtier"
    if package.is_dir():
        edges.update(python_edges(package, "kvtier"))
    for c in circles(edges):
        out.append("import circle: " + " <-> ".join(str(p.relative_to(root)) for p in c))
    for folder in SIZE_CHECKED:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".rs", ".py") and path.is_file():
                n = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
                if n > LINES_MAX:
                    out.append(f"{path.relative_to(root)}: {n} lines (at most {LINES_MAX}: split it by concern)")
    main = root / "loadgen" / "src" / "main.rs"
    if main.exists():
        n = len(main.read_text(encoding="utf-8").splitlines())
        if n > MAIN_LINES_MAX:
            out.append(f"loadgen/src/main.rs: {n} lines (at most {MAIN_LINES_MAX}: it only dispatches)")
    return out


def self_test() -> None:
    """The checker finds a Rust circle, a Python circle and a long file,
    and passes a tree without them."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "engine" / "src"
        (src / "shard").mkdir(parents=True)
        (root / "engine" / "Cargo.toml").write_text("[package]\n")
        (src / "lib.rs").write_text("pub mod a;\npub mod shard;\n")
        (src / "a.rs").write_text("use crate::shard::b::Thing;\n")
        (src / "shard" / "mod.rs").write_text("pub mod b;\nuse self::b::Thing;\n")
        (src / "shard" / "b.rs").write_text("pub struct Thing;\n")
        assert breaches(root) == [], breaches(root)
        (src / "shard" / "b.rs").write_text("use super::super::a;\npub struct Thing;\n")
        found = breaches(root)
        assert len(found) == 1 and "engine/src/a.rs" in found[0] and "shard/b.rs" in found[0], found
        (src / "shard" / "b.rs").write_text("pub struct Thing;\n" + "// x\n" * LINES_MAX)
        found = breaches(root)
        assert found == [f"engine/src/shard/b.rs: {LINES_MAX + 1} lines (at most {LINES_MAX}: split it by concern)"], found
        (src / "shard" / "b.rs").write_text("pub struct Thing;\n")
        package = root / "clients" / "python" / "src" / "kvtier"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("from .client import Client\n")
        (package / "client.py").write_text("from ._unix import open_local\n")
        (package / "_unix.py").write_text("import os\n")
        assert breaches(root) == []
        (package / "_unix.py").write_text("from kvtier.client import Client\n")
        found = breaches(root)
        assert len(found) == 1 and "_unix.py" in found[0] and "client.py" in found[0], found
        # Across subpackages, relative and absolute.
        (package / "_unix.py").write_text("import os\n")
        (package / "transport").mkdir()
        (package / "transport" / "__init__.py").write_text("")
        (package / "transport" / "unix.py").write_text("from .. import client\n")
        (package / "client.py").write_text("from .transport.unix import open_local\n")
        found = breaches(root)
        assert len(found) == 1 and "transport/unix.py" in found[0] and "client.py" in found[0], found
        (package / "transport" / "unix.py").write_text("from ..errors import X\n")
        assert breaches(root) == [], breaches(root)
    print("check_layout self-test: ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        sys.exit(0)
    found = breaches(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd()).resolve())
    for line in found:
        print(line)
    if not found:
        print("check_layout: no import circle, no file over the limits")
    sys.exit(1 if found else 0)
