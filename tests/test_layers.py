"""The import layers of docs/DESIGN.md ("Layers"), enforced on the source.

* Every lrmq module belongs to exactly one layer of `LAYERS`; a new module must be placed there.
* A module imports lrmq modules of its own layer or below, never above.
* No import cycle, not even within a layer.
* Imports of lrmq / pallas_kernels sit at module top, never inside functions (where they used to
  hide backward imports and cycles).
"""
from __future__ import annotations

import ast
import os

import pytest

from conftest import REPO_ROOT

# Bottom-up. Modules are named exactly, packages (ending in ".") by prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("lrmq", "lrmq.registry", "lrmq.paths", "lrmq.atomic", "lrmq.compile_cache", "lrmq.cli", "lrmq.configlib",
              "lrmq.targets",
              "lrmq.config_help", "lrmq.sharding", "lrmq.tokenizer", "lrmq.grading", "lrmq.grading.",
              "lrmq.hlo", "lrmq.tensorboard")),
    ("formats", ("lrmq.quant", "lrmq.quant.packing", "lrmq.quant.quantizers", "lrmq.quant.qweight",
                 "lrmq.quant.nf4", "lrmq.quant.formats", "lrmq.quant.qmatmul",
                 "lrmq.quant.qkernel",
                 # the exported checkpoints' tensor layouts (numpy only): written by the PTQ exporters, read back by
                 # lrmq.checkpoint.quantized
                 "lrmq.ptq.export_formats")),
    ("model", ("lrmq.model", "lrmq.model.")),
    ("transforms", ("lrmq.quant.transforms", "lrmq.quant.qat", "lrmq.quant.lora",
                    "lrmq.quant.training", "lrmq.generation", "lrmq.generation.")),
    ("io", ("lrmq.checkpoint", "lrmq.checkpoint.", "lrmq.data", "lrmq.data.")),
    ("evaluation", ("lrmq.evals", "lrmq.evals.")),
    ("algorithms", ("lrmq.rl", "lrmq.rl.", "lrmq.ptq", "lrmq.ptq.")),
    ("drivers", ("lrmq.rl.trainer", "lrmq.rl.evaluation", "lrmq.perplexity", "lrmq.studies", "lrmq.studies.")),
    ("preflight", ("lrmq.aot", "lrmq.ptq_aot")),
    ("commands", ("lrmq.train", "lrmq.quantize", "lrmq.generate", "lrmq.convert", "lrmq.evaluate", "lrmq.study")),
]
FIRST_PARTY = ("lrmq", "pallas_kernels")


def _modules() -> dict[str, str]:
    out = {}
    base = os.path.join(REPO_ROOT, "lrmq")
    for dirpath, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> int:
    """The most specific match wins: an exact name over a package prefix."""
    best = None
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if module == m or (m.endswith(".") and module.startswith(m)):
                score = len(m) + (1000 if module == m else 0)
                if best is None or score > best[0]:
                    best = (score, i)
    if best is None:
        raise KeyError(module)
    return best[1]


def _imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported lrmq module, at module top?, line) for every first-party import in `module`."""
    path = MODULES[module]
    tree = ast.parse(open(path).read(), path)
    top = {id(n) for n in tree.body}
    nested_in_def = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nested_in_def.update(id(c) for c in ast.walk(node) if c is not node)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; use lrmq.…")
            base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] not in FIRST_PARTY:
                continue
            # top: a statement of the module body (or inside a top-level if / try), not in a def
            out.append((name, id(node) in top or id(node) not in nested_in_def, node.lineno))
    return out


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if _try_layer(m) is None]
    assert not missing, f"place these modules in a layer (tests/test_layers.py, docs/DESIGN.md): {missing}"


def _try_layer(m):
    try:
        return layer_of(m)
    except KeyError:
        return None


def _upward(m: str) -> list[str]:
    return [f"{m}:{line} ({LAYERS[layer_of(m)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
            for dep, _, line in _imports(m) if dep in MODULES and layer_of(dep) > layer_of(m)]


def test_imports_go_down_the_layers():
    bad = [b for m in sorted(MODULES) for b in _upward(m)]
    assert not bad, "\n".join(bad)


def test_first_party_imports_sit_at_module_top():
    bad = [f"{MODULES[m]}:{line}: {dep}" for m in sorted(MODULES)
           for dep, at_top, line in _imports(m) if not at_top]
    assert not bad, "imports inside functions:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {d for d, _, _ in _imports(m) if d in MODULES and d != m} for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_rules_can_fail(tmp_path):
    """The checks above see what they claim to: an upward import is found and a lazy one too."""
    assert layer_of("lrmq.model.linear") < layer_of("lrmq.quant.training")
    assert layer_of("lrmq.rl.trainer") > layer_of("lrmq.rl.step")  # exact name beats the package
    src = tmp_path / "probe.py"
    src.write_text("import os\n\ndef f():\n    from lrmq.quant.training import pack_linears\n")
    MODULES["lrmq.model.probe"] = str(src)
    try:
        [(dep, at_top, _)] = _imports("lrmq.model.probe")
        assert dep == "lrmq.quant.training" and not at_top
        assert layer_of(dep) > layer_of("lrmq.model.probe")
    finally:
        del MODULES["lrmq.model.probe"]


# Imports that once ran back up the layers (issue 26): each must stay an error.
BACKWARD = [
    # the trainer reaches the preflight through lrmq.rl.precompile and a callable lrmq.train hands it
    ("lrmq.rl.trainer", "lrmq.aot"),
    # grading sits below both RL and evaluation: the evaluation suites never import the RL rewards to grade
    ("lrmq.evals.scorers", "lrmq.rl.rewards"),
    ("lrmq.grading.answers", "lrmq.rl.rewards"),
    ("lrmq.grading.answers", "lrmq.evals.scorers"),
    # the logical-axes key lives with sharding; the model imports it from there
    ("lrmq.sharding", "lrmq.model.params"),
]


@pytest.mark.parametrize("importer, imported", BACKWARD)
def test_backward_imports_stay_errors(tmp_path, importer, imported):
    """The placements above: a module at `importer`'s place importing `imported` is reported, at module top."""
    assert layer_of(imported) > layer_of(importer)
    assert imported not in {d for d, _, _ in _imports(importer)}
    src = tmp_path / "probe.py"
    src.write_text(f"import {imported}\n")
    saved = MODULES[importer]
    MODULES[importer] = str(src)
    try:
        assert _upward(importer), f"{importer} importing {imported} was not reported"
    finally:
        MODULES[importer] = saved


def test_preflight_pieces_below_the_trainer():
    """What the trainer and lrmq.aot share (update shapes, memory budget) sits below both."""
    assert layer_of("lrmq.rl.precompile") < layer_of("lrmq.rl.trainer") < layer_of("lrmq.aot") < layer_of("lrmq.train")
    assert layer_of("lrmq.sharding") < layer_of("lrmq.model.params")
    assert layer_of("lrmq.grading.answers") < layer_of("lrmq.evals.scorers") < layer_of("lrmq.rl.rewards")
