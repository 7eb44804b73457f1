"""The package's layers hold: no module imports one of a higher layer (function-level imports included).

Run ``python tests/test_layers.py`` to print the graph's summary and any upward arrow."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bnprobe"
# bottom to top; a module may import its own layer and those below it
LAYERS = (("errors", "_files", "_table", "_progress", "_loading", "_jit", "_jit_bits", "tolerances", "formats", "guard",
           "call", "conventions"),
          ("numerics", "inputs"), ("kernels",), ("metrics",), ("adapters", "recordings"), ("checks",), ("sweep",),
          ("plots",),
          ("reports",), ("cli", "__main__", "__init__"))


def layer_of(module: str) -> int:
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, names in enumerate(LAYERS) if head in names)


def arrows() -> tuple[int, list[str]]:
    """(imports between bnprobe modules, the upward ones as text)."""
    count, up = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__") if rel.name != "__init__" or len(rel.parts) > 2 \
            else "bnprobe.__init__"
        me = layer_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = ["bnprobe.__init__" if node.module == "bnprobe" else node.module]
            else:
                continue
            for t in (t for t in targets if t.startswith("bnprobe.")):
                count += 1
                if layer_of(t) > me:
                    up.append(f"{module} (layer {me}) imports {t} (layer {layer_of(t)}), line {node.lineno}")
    return count, up


def test_every_module_has_a_layer_and_no_import_points_up():
    count, up = arrows()
    assert count > 200 and not up, "\n".join(up)


def test_an_upward_import_would_be_seen(tmp_path, monkeypatch):
    """The check can fail: a kernel module importing the reports is an upward arrow."""
    pkg = tmp_path / "bnprobe"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "kernels" / "bad.py").write_text("def f():\n    from bnprobe.reports import dumps_json\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PACKAGE", pkg)
    assert arrows() == (1, ["bnprobe.kernels.bad (layer 2) imports bnprobe.reports (layer 8), line 2"])


if __name__ == "__main__":
    n, upward = arrows()
    print(f"{n} imports between bnprobe modules; layers, bottom to top: "
          + " < ".join("{" + ", ".join(names) + "}" for names in LAYERS))
    print(f"upward arrows: {len(upward)}", *upward, sep="\n")


def _module_graph() -> dict[str, set[str]]:
    """bnprobe's modules and the bnprobe modules each imports (top level, in functions and under TYPE_CHECKING);
    ``from bnprobe.pkg import name`` counts as importing the submodule bnprobe.pkg.name when there is one."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        files[".".join(rel.parts).removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            else:
                continue
            graph[module] |= {t for t in targets if t in files and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(_module_graph()) == []


def test_a_circle_would_be_seen():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args
                positional = len(args) - (1 if args and args[0].arg in ("self", "cls") else 0)
                yield path.relative_to(PACKAGE.parent), node, positional


def test_functions_stay_short_and_take_few_positional_parameters():
    """No function over 80 lines; outside the CLI (typer's options are parameters) and the numba kernels (which
    take arrays, not objects), at most 3 functions take more than 8 positional parameters."""
    long = [f"{p}:{n.lineno} {n.name}" for p, n, _ in _functions() if n.end_lineno - n.lineno + 1 > 80]
    many = [f"{p}:{n.lineno} {n.name} ({k})" for p, n, k in _functions() if k > 8
            and p.name != "cli.py" and not p.name.startswith("compiled_")]
    assert not long, long
    assert len(many) <= 3, many
