"""The house has no circles: the modules of pipeline/ import each other as a DAG, counting
imports inside functions too (a cycle there only waits for the first call to bite)."""

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "pipeline"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the pipeline modules it imports anywhere in its file. `from pkg import name`
    counts as importing pkg.name when that is a module, else pkg (its __init__)."""
    modules = module_names()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                if base in modules:
                    graph[name] |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name].discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_pipeline_imports_form_a_dag():
    graph = import_graph()
    assert "pipeline.decode.types" in graph and graph["pipeline.eval.stage"]  # the walk sees the package
    assert find_cycle(graph) == []


def test_decode_imports_only_downward():
    """types at the bottom, then cache and sampling, then the drafters, then the loops."""
    order = ["types", "static_kv", "sampling", "chain", "ngram", "draft_model", "medusa", "eagle", "prepare", "decoder",
             "tree"]
    graph = import_graph()
    assert {m for m in graph if m.startswith("pipeline.decode.")} == {f"pipeline.decode.{m}" for m in order}
    for i, name in enumerate(order):
        below = {f"pipeline.decode.{m}" for m in order[:i]}
        ours = {m for m in graph[f"pipeline.decode.{name}"] if m.startswith("pipeline.decode")}
        assert ours <= below, (name, ours - below)
    assert not any(m.startswith("pipeline.") and not m.startswith(("pipeline.decode", "pipeline.kernels"))
                   for name in order for m in graph[f"pipeline.decode.{name}"])


def test_the_decoder_has_one_protocol_and_one_drafter_per_module():
    """One decoding path: one Protocol (types.Drafter), and one drafter class in each drafter
    module (early exit drafts as a model: draft_model.py)."""
    def classes(module: str) -> list[ast.ClassDef]:
        tree = ast.parse((PACKAGE / "decode" / f"{module}.py").read_text())
        return [node for node in tree.body if isinstance(node, ast.ClassDef)]

    protocols = [c.name for m in ("types", "static_kv", "chain", "decoder", "tree") for c in classes(m)
                 if any(getattr(b, "id", "") == "Protocol" for b in c.bases)]
    assert protocols == ["Drafter"]
    for module in ("ngram", "draft_model", "medusa", "eagle"):
        assert len([c for c in classes(module) if c.name.endswith("Drafter")]) == 1, module


def test_kernels_are_the_bottom_of_the_house():
    """pipeline/kernels/ imports nothing of ours outside itself: the decoder and training use it."""
    graph = import_graph()
    kernels = [name for name in graph if name.startswith("pipeline.kernels")]
    assert "pipeline.kernels.linear" in kernels
    for name in kernels:
        assert all(m.startswith("pipeline.kernels") for m in graph[name]), (name, graph[name])


def test_export_does_not_import_eval():
    graph = import_graph()
    reach, todo = set(), ["pipeline.export"]
    while todo:
        for nxt in graph[todo.pop()] - reach:
            reach.add(nxt)
            todo.append(nxt)
    assert not any(m.startswith("pipeline.eval") for m in reach), sorted(m for m in reach if "eval" in m)


def test_training_stages_share_the_core_not_each_other():
    """distill and heads both train through pipeline/train/ (data, losses, the loop); neither
    imports the other's modules, and the core imports no stage."""
    graph = import_graph()
    for stage in ("pipeline.distill.stage", "pipeline.heads.stage"):
        assert "pipeline.train.loop" in graph[stage], stage
    heads = {m for m in graph if m.startswith("pipeline.heads")}
    distill = {m for m in graph if m.startswith("pipeline.distill")}
    assert not any(graph[m] & distill for m in heads), {m: graph[m] & distill for m in heads}
    assert not any(graph[m] & heads for m in distill)
    for core in (m for m in graph if m.startswith("pipeline.train")):
        assert not graph[core] & (heads | distill | {"pipeline.eval", "pipeline.export"}), (core, graph[core])


def test_the_kinds_table_sits_below_the_stages():
    """pipeline.kinds (what every stage reads) imports no stage package: the engine layouts it
    writes for heads live in pipeline/heads/formats.py, not in export/."""
    graph = import_graph()
    above = ("pipeline.export", "pipeline.eval", "pipeline.distill.stage", "pipeline.heads.stage", "pipeline.data")
    assert not {m for m in graph["pipeline.kinds"] if m.startswith(above)}, graph["pipeline.kinds"]
