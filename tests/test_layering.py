"""The package imports one way, from the public API down to the kernels, and has no import cycle.

Every ``import`` in every module counts, also those inside functions and under ``TYPE_CHECKING``: a lazy
import back up is still a dependency back up. (README, "Layout", says the order in words.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minipd"

#: Lowest first. A module may import its own level or any level below; the longest prefix decides.
LEVELS: tuple[tuple[str, ...], ...] = (
    ("minipd.errors", "minipd.messages", "minipd.wire", "minipd._lazy", "minipd.device", "minipd.config",
     "minipd.sampling_params", "minipd.outputs", "minipd.tokenizer"),
    ("minipd.kv.spec", "minipd.kv.quant"),  # how K/V are stored: kernels and the pool both take it
    ("minipd.kernels",),
    ("minipd.moe",),  # a MoE layer's parts
    ("minipd.kv",),
    ("minipd.layers",),
    ("minipd.models",),
    ("minipd.engine",),
    ("minipd.llm_base", "minipd.llm", "minipd.async_llm"),
    ("minipd.pd",),
    ("minipd",),  # the package's lazy public exports
    ("minipd.evaluation", "minipd.sim", "minipd.bench", "minipd.viz", "minipd.exercises", "minipd.serve"),
    ("minipd.cli", "minipd.__main__"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def level(module: str) -> int:
    best, found = -1, None
    for index, prefixes in enumerate(LEVELS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found is not None, f"{module} is on no level of LEVELS: add it"
    return found


def imports_of(module: str) -> set[str]:
    """The minipd modules ``module`` imports; ``from package import submodule`` names the submodule."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "minipd"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "minipd":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if level(b) > level(a))


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target in graph and not state.get(target):
                visit(target, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if not state.get(module):
            visit(module, [])
    return cycles


def test_every_import_points_down_or_sideways():
    found = upward(GRAPH)
    assert not found, "imports back up the layers:\n" + "\n".join(found)


def test_no_module_imports_itself_back():
    found = cycles_in(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checks_see_an_import_back_up_and_a_cycle():
    graph = {m: set(t) for m, t in GRAPH.items()}
    graph["minipd.kernels.paged_attention"].add("minipd.layers.attention")  # how it was before
    graph["minipd.kv.paged_pool"].add("minipd.kv.residual")
    graph["minipd.kv.residual"].add("minipd.kv.paged_pool")
    assert upward(graph) == ["minipd.kernels.paged_attention -> minipd.layers.attention"]
    assert any(set(c) == {"minipd.kv.paged_pool", "minipd.kv.residual"} for c in cycles_in(graph))
    assert not any(set(c) == {"minipd.kv.paged_pool", "minipd.kv.residual"} for c in cycles_in(GRAPH))
