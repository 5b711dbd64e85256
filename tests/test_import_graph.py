"""The package's import graph: no cycles, and every import goes down the layers."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pagedllm

PACKAGE_DIR = Path(pagedllm.__file__).parent

# Bottom to top; a module may import its own entry and any lower one. Packages that share an
# entry may import each other: the base modules (layer 0) are leaves every layer uses, and
# llm/eval (layer 12) are siblings over the engine (eval may drive an LLM).
LAYERS: list[tuple[str, ...]] = [
    ("pagedllm.config", "pagedllm.sampling_params", "pagedllm.pooling_params",
     "pagedllm.outputs", "pagedllm.paths", "pagedllm.shard",
     "pagedllm.version", "pagedllm.logger"),
    ("pagedllm.kernels",),
    ("pagedllm.platforms",),
    ("pagedllm.distributed",),
    ("pagedllm.structured_output",),
    ("pagedllm.lora",),  # LoRARequest (core's requests carry it) and reading PEFT adapters
    ("pagedllm.core",),
    ("pagedllm.loader",),
    ("pagedllm.tokenizer",),  # tokenizers and chat templates: read GGUF metadata
    ("pagedllm.hub",),  # the model store and the Hub: build tokenizers, read headers
    ("pagedllm.memory",),  # planning on metadata: below the workers, executors and engine
    ("pagedllm.sample",),
    ("pagedllm.attention",),
    ("pagedllm.layers",),
    ("pagedllm.models",),
    ("pagedllm.worker",),
    ("pagedllm.executor",),
    ("pagedllm.engine",),
    ("pagedllm.llm", "pagedllm.eval"),
    ("pagedllm.entrypoints",),
    ("pagedllm", "pagedllm.__main__"),  # the package itself: nothing may import it
]

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    """Dotted name of a source file under `root` (the package's parent directory)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """Absolute name of the module an ImportFrom names (relative ones resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Modules of `known` that one module imports anywhere (top level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != module}


def build_graph(package_dir: Path) -> Graph:
    """Importer -> imported, over every module of the package."""
    files = {module_name(p, package_dir.parent): p for p in sorted(package_dir.rglob("*.py"))}
    known = set(files)
    return {name: imports_of(ast.parse(path.read_text(), str(path)), name,
                             path.name == "__init__.py", known)
            for name, path in files.items()}


def find_cycle(graph: Graph) -> Optional[list[str]]:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: fully explored
    stack: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> Optional[int]:
    """Index of the entry whose longest prefix names `module`, or None."""
    best: Optional[tuple[int, int]] = None  # (prefix length, layer)
    for index, prefixes in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def upward_edges(graph: Graph, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """'importer (layer a) -> imported (layer b)' for every import of a higher layer."""
    bad = []
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            a, b = layer_of(importer, layers), layer_of(imported, layers)
            if a is not None and b is not None and b > a:
                bad.append(f"{importer} (layer {a}) -> {imported} (layer {b})")
    return bad


def test_checker_reports_a_cycle_and_an_upward_edge():
    layers = [("p.low",), ("p.high",)]
    graph = {"p.low.a": {"p.low.b"}, "p.low.b": {"p.high.c"}, "p.high.c": {"p.low.a"}}
    assert find_cycle(graph) == ["p.high.c", "p.low.a", "p.low.b", "p.high.c"]
    assert upward_edges(graph, layers) == ["p.low.b (layer 0) -> p.high.c (layer 1)"]
    del graph["p.low.b"]
    assert find_cycle(graph) is None


def test_checker_reads_imports_anywhere_and_resolves_relative_ones():
    known = {"p", "p.sub", "p.sub.m", "p.sub.n", "p.other"}
    source = ("from . import n\nfrom .. import other\nimport p.sub\n"
              "def f():\n    from p.sub.n import thing\n    from p import sub\n    import os\n")
    assert imports_of(ast.parse(source), "p.sub.m", False, known) == {"p.sub.n", "p.other", "p.sub"}


def test_import_graph_has_no_cycle():
    graph = build_graph(PACKAGE_DIR)
    assert len(graph) >= 60 and sum(map(len, graph.values())) >= 100, "the graph looks empty"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_go_down_the_layers():
    graph = build_graph(PACKAGE_DIR)
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules missing from LAYERS: {unplaced}"
    bad = upward_edges(graph)
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


# The engine reaches the model only through the executor: what runs below it (model code, its
# layers, kernels, attention, sampling, the worker) is the executor's business. Memory planning
# (pagedllm.memory: footprint, plan, advice, weight formats, per-rank limits) is a package of
# its own below them all, which the config builder calls before anything is loaded.
ENGINE_MAY_NOT_IMPORT = ("pagedllm.models", "pagedllm.layers", "pagedllm.kernels",
                         "pagedllm.attention", "pagedllm.sample", "pagedllm.worker")


def engine_reaches_below_the_executor(graph: Graph) -> list[str]:
    """'importer -> imported' for each engine module importing what the executor hides."""
    def hidden(m: str) -> bool:
        return any(m == p or m.startswith(p + ".") for p in ENGINE_MAY_NOT_IMPORT)
    return [f"{a} -> {b}" for a in sorted(graph) if a.startswith("pagedllm.engine")
            for b in sorted(graph[a]) if hidden(b)]


def test_engine_imports_nothing_below_the_executor():
    graph = build_graph(PACKAGE_DIR)
    assert engine_reaches_below_the_executor(
        {"pagedllm.engine.x": {"pagedllm.layers.norm", "pagedllm.memory.plan",
                                "pagedllm.worker.worker"}}) == [
        "pagedllm.engine.x -> pagedllm.layers.norm", "pagedllm.engine.x -> pagedllm.worker.worker"]
    bad = engine_reaches_below_the_executor(graph)
    assert not bad, "the engine imports below the executor:\n" + "\n".join(bad)


# The engine's configuration and doctor plan on metadata with pagedllm.memory: neither reaches
# the workers or the executors (the engine core does, through the Executor interface, and
# hands the config builder the executors' reading of a cluster's rank nodes).
PLANNERS = ("pagedllm.engine.config_builder", "pagedllm.entrypoints.doctor")
PLANNERS_MAY_NOT_IMPORT = ("pagedllm.worker", "pagedllm.executor")


def planners_reaching_workers(graph: Graph) -> list[str]:
    """'importer -> imported' for each of PLANNERS importing a worker or an executor module."""
    return [f"{a} -> {b}" for a in PLANNERS for b in sorted(graph.get(a, ()))
            if any(b == p or b.startswith(p + ".") for p in PLANNERS_MAY_NOT_IMPORT)]


def test_config_builder_and_doctor_import_no_worker_or_executor():
    graph = build_graph(PACKAGE_DIR)
    assert planners_reaching_workers(
        {"pagedllm.entrypoints.doctor": {"pagedllm.memory.plan", "pagedllm.executor.ray_nodes"}}
    ) == ["pagedllm.entrypoints.doctor -> pagedllm.executor.ray_nodes"]
    assert all(p in graph for p in PLANNERS), "a planner module moved: update PLANNERS"
    bad = planners_reaching_workers(graph)
    assert not bad, "the planners import workers or executors:\n" + "\n".join(bad)


# Loading a checkpoint needs no distributed/ (a rank's part of a tensor is pagedllm.shard), and
# the two formats' readers are independent: what GGUF and Hugging Face files share is loader/'s.
APART: tuple[tuple[str, str], ...] = (
    ("pagedllm.loader", "pagedllm.distributed"), ("pagedllm.tokenizer", "pagedllm.distributed"),
    ("pagedllm.hub", "pagedllm.distributed"), ("pagedllm.loader.gguf", "pagedllm.loader.hf"),
    ("pagedllm.loader.hf", "pagedllm.loader.gguf"))


def imports_across(graph: Graph, pairs: tuple[tuple[str, str], ...] = APART) -> list[str]:
    """'importer -> imported' for each module under a pair's first package importing one
    under its second."""
    def under(m: str, p: str) -> bool:
        return m == p or m.startswith(p + ".")
    return [f"{a} -> {b}" for src, dst in pairs for a in sorted(graph) if under(a, src)
            for b in sorted(graph[a]) if under(b, dst)]


def test_loaders_import_no_distributed_and_the_formats_stay_apart():
    graph = build_graph(PACKAGE_DIR)
    assert imports_across({"pagedllm.loader.hf.x": {"pagedllm.loader.gguf.y", "pagedllm.shard"},
                           "pagedllm.loader.z": {"pagedllm.distributed.tensor_parallel"}}) == [
        "pagedllm.loader.z -> pagedllm.distributed.tensor_parallel",
        "pagedllm.loader.hf.x -> pagedllm.loader.gguf.y"]
    assert all(p in graph for p in ("pagedllm.loader.gguf", "pagedllm.loader.hf",
                                    "pagedllm.tokenizer", "pagedllm.hub")), "a package moved"
    bad = imports_across(graph)
    assert not bad, "imports across packages kept apart:\n" + "\n".join(bad)
