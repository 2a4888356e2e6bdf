"""The package layering of docs/architecture.md ("Layout"), checked on the source.

Every module under src/zerokit is parsed (ast: nothing is imported, so a broken module cannot hide
an import), every `zerokit.*` import in it, at the top, inside functions or under TYPE_CHECKING,
is mapped to the package it reaches, and:
- a package may import only packages of lower layers (LAYERS below, lowest first; packages of
  one layer are independent of each other), except the imports listed in UPWARD with the reason;
- the packages' import graph has no cycle (checked on the imports themselves, not on LAYERS, so a
  wrong edit of the table cannot hide one).
A "package" is a folder of src/zerokit (units, parts, engine, ...) or a top-level module (zero.py,
tiling.py, logs.py, ...); `zerokit` is the package's own __init__.py, the public surface, which
the compatibility layer and the command line use.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "zerokit"

# Lowest first. Keep in step with the table in docs/architecture.md ("Layout (as built)").
LAYERS: list[tuple[str, ...]] = [
    ("logs", "sizes", "states", "tier_names"),  # vocabulary: import no other package
    ("io", "comm", "policy", "data", "models"),
    ("config", "tiers"),
    ("optim",),
    ("parts",),
    ("units",),
    ("checkpoint", "gather", "activations"),
    ("pretrained",),
    ("tiling",),
    ("zero",),
    ("export",),
    ("engine",),
    ("memory",),            # the estimator plans a meta-device model with the engine's rules
    ("zerokit",),           # __init__.py: the public surface
    ("compat", "cli"),      # users of the public surface: `import deepspeed`, `zerokit train`
]

# (importing file relative to src/zerokit, imported module) -> why it is allowed to point upward.
UPWARD: dict[tuple[str, str], str] = {
    ("config/plan.py", "zerokit.engine.engine"):
        "annotation only (TYPE_CHECKING): explain() reads a built engine's units and policies; "
        "the start-up report belongs beside the engine, a move left for later",
    ("export.py", "zerokit.engine.engine"):
        "annotation only (TYPE_CHECKING): save_16bit_model(engine, ...) is DeepSpeed's API on "
        "an engine; export.py itself uses only the engine's units and comm",
    ("io/__init__.py", "zerokit.tiers.nvme_swapper"):
        "function-level (PEP 562, on first use): zerokit.io.TensorSwapper stays the public name of "
        "the swapper, which now lives on the nvme tier (tiers/nvme_swapper.py)",
    ("engine/deepspeed_api.py", "zerokit.compat.deepspeed.version"):
        "function-level: load_checkpoint's answer under DeepSpeed's API carries ds_version, the "
        "DeepSpeed version the compatibility layer mirrors (one constant, kept there)",
    ("engine/wall_clock.py", "zerokit.compat.deepspeed.accelerator"):
        "function-level: engine.timers.memory_usage() prints DeepSpeed's memory line from the "
        "accelerator's figures, which the compatibility layer's accelerator owns",
    ("tiling.py", "zerokit.zero"):
        "function-level: the tiles gather through zero.GatheredParameters, and zero.py "
        "re-exports the tiles as its public API (zero.TiledLinear, as DeepSpeed)",
}

LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package_of(module: str) -> str:
    """zerokit.units.unit -> units; zerokit.zero -> zero; zerokit -> zerokit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "zerokit"


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported zerokit module, line) for every import statement anywhere in the file."""
    this = module_name(path)
    package = this.split(".") if path.name == "__init__.py" else this.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from zerokit import zero` imports the module zerokit.zero
            names = [f"{base}.{a.name}" for a in node.names] if base == "zerokit" else [base]
        else:
            continue
        found += [(n, node.lineno) for n in names if n == "zerokit" or n.startswith("zerokit.")]
    return found


def all_imports() -> list[tuple[str, str, str, int]]:
    """(importing file relative to src/zerokit, its package, imported module, line)."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for target, line in imports_of(path):
            out.append((rel, package_of(module_name(path)), target, line))
    return out


def packages_on_disk() -> set[str]:
    return {package_of(module_name(p)) for p in SRC.rglob("*.py")}


def test_every_package_has_a_layer() -> None:
    missing = packages_on_disk() - set(LAYER_OF)
    assert not missing, (f"packages {sorted(missing)} are in no layer: add them to LAYERS here "
                         f"and to the table in docs/architecture.md")
    gone = set(LAYER_OF) - packages_on_disk()
    assert not gone, f"LAYERS names packages that no longer exist: {sorted(gone)}"


def test_no_package_imports_upward() -> None:
    bad = []
    for rel, pkg, target, line in all_imports():
        to = package_of(target)
        if to == pkg or LAYER_OF[to] < LAYER_OF[pkg] or (rel, target) in UPWARD:
            continue
        bad.append(f"src/zerokit/{rel}:{line} imports {target}: {pkg} (layer {LAYER_OF[pkg]}) "
                   f"may not import {to} (layer {LAYER_OF[to]})")
    assert not bad, ("imports that point up or sideways in the layering of docs/architecture.md; "
                     "move the code to the layer it belongs to, or list the import in UPWARD "
                     "with the reason:\n" + "\n".join(bad))


def test_every_listed_exception_still_exists() -> None:
    present = {(rel, target) for rel, _, target, _ in all_imports()}
    stale = [key for key in UPWARD if key not in present]
    assert not stale, f"UPWARD lists imports the code no longer has (remove them): {stale}"


def test_no_cycle_between_packages() -> None:
    graph: dict[str, dict[str, str]] = {}
    for rel, pkg, target, line in all_imports():
        to = package_of(target)
        if to != pkg and (rel, target) not in UPWARD:
            graph.setdefault(pkg, {}).setdefault(to, f"src/zerokit/{rel}:{line}")
    cycle = find_cycle(graph)
    assert cycle is None, "packages import each other in a cycle: " + " -> ".join(
        f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """A cycle [a, b, ..., a] in the graph, or None (depth-first, colouring the nodes)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


@pytest.mark.parametrize("graph,cyclic", [
    ({"a": {"b": ""}, "b": {"c": ""}}, False),
    ({"a": {"b": ""}, "b": {"a": ""}}, True),
    ({"a": {"b": "", "c": ""}, "c": {"d": ""}, "d": {"a": ""}}, True),
])
def test_find_cycle_itself(graph, cyclic) -> None:
    assert (find_cycle(graph) is not None) == cyclic


def test_the_import_forms_are_resolved() -> None:
    # The parser is what the checks stand on: each import form must map to the right module.
    assert package_of("zerokit.units.unit") == "units" and package_of("zerokit.zero") == "zero"
    imported = {t for _, _, t, _ in all_imports()}
    assert "zerokit.zero" in imported        # `from zerokit import zero` (zerokit/__init__.py)
    assert "zerokit.io.aio" in imported      # function-level (config/schema.py)
    assert "zerokit.engine.engine" in imported  # under TYPE_CHECKING (engine/health.py and more)
