"""The package's layers hold: no module imports one of a higher layer (function-level imports included).

Run ``python tests/test_layers.py`` to print the graph's summary and any upward arrow."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "bnprobe"
# bottom to top; a module may import its own layer and those below it
LAYERS = (("compiled", "_progress", "_table"), ("core",), ("_files", "_loading", "guard"), ("numerics", "inputs"),
          ("kernels",), ("recordings",), ("adapters",), ("engine",), ("checks",), ("sweep",), ("plots",),
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
    assert arrows() == (1, ["bnprobe.kernels.bad (layer 4) imports bnprobe.reports (layer 11), line 2"])


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
    """No function over 80 lines; outside the CLI (typer's options are parameters) and the compiled route (numba
    kernels, which take arrays, not objects), at most 3 functions take more than 8 positional parameters."""
    long = [f"{p}:{n.lineno} {n.name}" for p, n, _ in _functions() if n.end_lineno - n.lineno + 1 > 80]
    many = [f"{p}:{n.lineno} {n.name} ({k})" for p, n, k in _functions() if k > 8
            and p.name != "cli.py" and p.parent.name != "compiled"]
    assert not long, long
    assert len(many) <= 3, many


def _parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every parameter a function takes: positional-only, positional, keyword-only, ``*args`` and ``**kwargs`` (a
    method's self or cls aside)."""
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    return len(names) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg) - (names[:1] in (["self"], ["cls"]))


def _decorated_by(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """What a function's decorators are or call, by name: ``_command`` of ``@_command("trace")``, ``command`` of
    ``@app.command()``, ``njit`` of ``@njit(parallel=True)``."""
    out = set()
    for d in node.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


# typer's commands declare each option as a parameter; numba's kernels take their scalars one by one (bundled into
# tuples they would compile anew, and an inlined kernel's constant arguments might no longer fold)
_MANY_PARAMETERS_BY = {"_command", "command", "njit", "jit"}
MAX_PARAMETERS = 10


def _many_parameters(package: Path) -> dict[str, int]:
    """path:function -> its parameters, of the functions taking more than MAX_PARAMETERS of any kind (typer's commands
    and numba's kernels aside, by their decorators)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _decorated_by(node) & \
                    _MANY_PARAMETERS_BY and (k := _parameter_count(node)) > MAX_PARAMETERS:
                out[f"{path.relative_to(package.parent).as_posix()}:{node.name}"] = k
    return out


def test_no_function_takes_more_than_ten_parameters():
    """A function's options that belong together travel as one value (a frozen dataclass, the call's BNCall), not
    as a keyword each."""
    assert _many_parameters(PACKAGE) == {}


def test_a_function_with_many_parameters_would_be_seen(tmp_path):
    pkg = tmp_path / "bnprobe"
    (pkg / "compiled").mkdir(parents=True)
    ten = ", ".join(f"a{i}" for i in range(10))
    (pkg / "api.py").write_text(f"def wide(x, *, {ten}):\n    pass\n\n\n"  # 11: keyword-only ones count
                                f"def star(a, b, c, d, e, f, g, h, i, *args, **kwargs):\n    pass\n\n\n"  # 11
                                f"class K:\n    def method(self, {ten}):\n        pass\n\n\n"  # 10 and self
                                f"def ten({ten}):\n    pass\n")
    (pkg / "cli.py").write_text(f"@_command('x')\ndef cmd(x, {ten}):\n    pass\n\n\n"
                                f"@app.command()\ndef other(x, {ten}):\n    pass\n\n\n"
                                f"def helper(x, *, {ten}):\n    pass\n")
    (pkg / "compiled" / "k.py").write_text(f"@njit(parallel=True)\ndef kernel(x, {ten}):\n    pass\n")
    assert _many_parameters(pkg) == {"bnprobe/api.py:wide": 11, "bnprobe/api.py:star": 11,
                                     "bnprobe/cli.py:helper": 11}


def _private_crossings(package: Path) -> list[str]:
    """Private names (one leading underscore) one bnprobe module takes from another: imported by name, or read as an
    attribute of a bnprobe module imported under a name."""
    files = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    out = []
    for module, path in sorted(files.items()):
        tree = ast.parse(path.read_text())
        modules: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] == "bnprobe" and node.module != module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in files:
                        modules[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"{path.relative_to(package.parent)}:{node.lineno} imports {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("bnprobe.")})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append(f"{path.relative_to(package.parent)}:{node.lineno} reads "
                           f"{modules[node.value.id]}.{node.attr}")
    return out


def test_no_private_name_crosses_a_module():
    assert _private_crossings(PACKAGE) == []


def test_a_private_name_crossing_would_be_seen(tmp_path):
    pkg = tmp_path / "bnprobe"
    (pkg / "checks").mkdir(parents=True)
    (pkg / "checks" / "a.py").write_text("def _helper():\n    return 1\n")
    (pkg / "checks" / "b.py").write_text("from bnprobe.checks.a import _helper\n")
    (pkg / "checks" / "c.py").write_text("from bnprobe.checks import a as m\n\nm._helper()\n")
    assert _private_crossings(pkg) == ["bnprobe/checks/b.py:1 imports bnprobe.checks.a._helper",
                                       "bnprobe/checks/c.py:3 reads bnprobe.checks.a._helper"]


# the calls that write a file given a path; where their first argument is an open file (a name: fh, buf) they write
# into a file the I/O module staged, or into memory
_WRITERS = {"save", "savez", "savez_compressed", "to_csv", "to_parquet", "savefig", "dump", "write_table"}
# what writes files through bnprobe._files (an OutputDir's methods and its functions): the CLI calls none of them
_FILE_API = {"write_text", "write_bytes", "write_with", "save_figure", "commit", "atomic_write_text",
             "atomic_write_bytes", "atomic_write_with", "append_text"}


def _raw_writes(package: Path) -> list[str]:
    """Files written outside the I/O module (bnprobe/_files.py): the builtin open() in a writing mode, a Path's
    write_text/write_bytes (one argument: an OutputDir's take a name and the data), a writer such as np.save or
    DataFrame.to_csv handed a path rather than an open file; and any file written by the CLI itself, which only
    renders (the reports write)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        if rel.as_posix() == "bnprobe/_files.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                 None)
            if isinstance(f, ast.Name) and name == "open" and isinstance(mode, ast.Constant) \
                    and set(str(mode.value)) & set("wax+"):
                out.append(f"{rel}:{node.lineno} open(..., {mode.value!r})")
            elif isinstance(f, ast.Attribute) and name in ("write_text", "write_bytes") and len(node.args) == 1:
                out.append(f"{rel}:{node.lineno} {name} on a path")
            elif isinstance(f, ast.Attribute) and name in _WRITERS and node.args \
                    and not isinstance(node.args[0], ast.Name):
                out.append(f"{rel}:{node.lineno} {name} to a path")
            elif rel.as_posix() == "bnprobe/cli.py" and name in _FILE_API:
                out.append(f"{rel}:{node.lineno} the CLI writes ({name})")
    return out


def test_files_are_written_through_the_io_module():
    assert _raw_writes(PACKAGE) == []


def test_a_raw_write_would_be_seen(tmp_path):
    pkg = tmp_path / "bnprobe"
    pkg.mkdir()
    (pkg / "_files.py").write_text("def w(p):\n    open(p, 'w')\n")  # the I/O module may
    (pkg / "sweep.py").write_text("import numpy as np\n\n\ndef f(p, folder, fh, sink, a):\n"
                                  "    open(p, 'a')\n    open(p)\n    p.write_text('x')\n"
                                  "    sink.write_text('n', 'x')\n"
                                  "    np.savez(folder / 'spill.npz', a=a)\n    np.save(fh, a)\n")
    (pkg / "cli.py").write_text("def g(sink):\n    sink.write_text('a.html', 'x')\n")
    assert _raw_writes(pkg) == ["bnprobe/cli.py:2 the CLI writes (write_text)",
                                "bnprobe/sweep.py:5 open(..., 'a')", "bnprobe/sweep.py:7 write_text on a path",
                                "bnprobe/sweep.py:9 savez to a path"]


def _is_call(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))


def _declared_flags(source: str) -> dict[str, list[int]]:
    """Each flag the command line declares and the lines that declare it: a command's own option (``typer.Option``
    as a parameter's default: its flags after the default, else ``--<parameter>``) and a group's option
    (``option(...)`` as a class's field: its flags, else ``--<field>``)."""
    found: dict[str, list[int]] = {}

    def add(call: ast.Call, name: str, flags: list[ast.expr]) -> None:
        given = [a.value for a in flags if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        for text in given or ["--" + name.replace("_", "-")]:
            for one in text.split("/"):  # --stress/--no-stress
                found.setdefault(one, []).append(call.lineno)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            a = node.args
            pairs = [*zip(a.args[len(a.args) - len(a.defaults):], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
            for arg, default in pairs:
                if _is_call(default, "Option"):
                    add(default, arg.arg, default.args[1:])
        elif isinstance(node, ast.ClassDef):
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and _is_call(st.value, "option"):
                    add(st.value, st.target.id, st.value.args)
    return found


# flags that name unrelated options of different commands, declared by each
HOMONYMS = {"--format": "rsqrt's number format, compare-precision's report files, plot-stats' image type"}


def test_an_option_several_commands_share_is_declared_once():
    """A shared option (its flags, metavar, range) is declared once, in its group of bnprobe/cli.py; a command
    words its help there, it does not declare the option again."""
    flags = _declared_flags((PACKAGE / "cli.py").read_text())
    assert len(flags) > 60 and all(len(flags[f]) > 1 for f in HOMONYMS)
    assert {f: lines for f, lines in flags.items() if len(lines) > 1 and f not in HOMONYMS} == {}


def test_an_option_declared_twice_would_be_seen():
    source = ("class Call(Group):\n"
              "    eps: Optional[float] = option(help='epsilon')\n"
              "    params: Optional[str] = option('--params')\n\n\n"
              "def trace(eps: float = typer.Option(1e-5), shape: str = typer.Option(None, '--shape')):\n"
              "    pass\n\n\n"
              "def overflow(*, shape: str = typer.Option('8,16,14,14', help='x'), params=Call.use()):\n"
              "    pass\n")
    assert {f: n for f, n in _declared_flags(source).items() if len(n) > 1} == {"--eps": [2, 6], "--shape": [6, 10]}


def _folder_shares(package: Path) -> dict[str, float]:
    """Each folder's share of the package's lines, counting the modules directly in it (a command's package under
    checks/ is a folder of its own)."""
    lines: dict[str, int] = {}
    for path in package.rglob("*.py"):
        folder = path.parent.relative_to(package.parent).as_posix()
        lines[folder] = lines.get(folder, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    return {folder: n / total for folder, n in sorted(lines.items())}


def test_no_folder_holds_more_than_a_quarter_of_the_package():
    shares = _folder_shares(PACKAGE)
    assert len(shares) >= 10 and max(shares.values()) <= 0.25, {k: round(v, 3) for k, v in shares.items()}


def test_a_crowded_folder_would_be_seen(tmp_path):
    pkg = tmp_path / "bnprobe"
    (pkg / "checks").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n" * 10)
    (pkg / "checks" / "big.py").write_text("x = 1\n" * 40)
    assert _folder_shares(pkg) == {"bnprobe": 0.2, "bnprobe/checks": 0.8}


def _summary(path: Path) -> str:
    """The first sentence of a module's (or a package's __init__'s) docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    text = re.sub(r":\w+:`~?\.?([^`]+)`", r"`\1`", text).replace("``", "`")  # Sphinx roles and literals as Markdown
    return text.split(". ")[0].rstrip(".").replace("|", "\\|")


def layout_markdown(package: Path, layers: tuple[tuple[str, ...], ...]) -> str:
    """The package's floors, top first, as a Markdown table: each room (a package or a module of the package's top
    level), what its docstring says it is, and what it holds (a package's modules and packages).  The docs'
    architecture page shows this table; a test keeps the two equal."""
    rows = ["| floor | room | what it is | holds |", "| --- | --- | --- | --- |"]
    for level in range(len(layers) - 1, -1, -1):
        for name in layers[level]:
            folder, module = package / name, package / f"{name}.py"
            if folder.is_dir():
                room, doc = f"`{name}/`", folder / "__init__.py"
                holds = sorted(p.stem if p.is_file() else p.name + "/" for p in folder.iterdir()
                               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file())
            elif module.is_file():
                room, doc, holds = f"`{name}.py`", module, []
            else:
                continue
            summary = _summary(doc) if doc.is_file() else ""
            rows.append(f"| {level} | {room} | {summary} | {', '.join(holds)} |")
    return "\n".join(rows) + "\n"


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
_BEGIN, _END = "<!-- layout: begin (python tests/test_layers.py --layout) -->", "<!-- layout: end -->"


def test_the_architecture_page_shows_the_layout_of_this_test():
    """The docs' architecture page holds the table :func:`layout_markdown` makes from LAYERS and the tree (re-make
    it with ``python tests/test_layers.py --layout``)."""
    page = ARCHITECTURE.read_text()
    shown = page.split(_BEGIN, 1)[1].split(_END, 1)[0].strip("\n") + "\n"
    assert shown == layout_markdown(PACKAGE, LAYERS), "re-make it: python tests/test_layers.py --layout"


def test_a_room_is_listed_on_its_floor(tmp_path):
    pkg = tmp_path / "bnprobe"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "__init__.py").write_text('"""The shared words. More."""\n')
    (pkg / "core" / "call.py").write_text("")
    (pkg / "cli.py").write_text('"""The command line."""\n')
    assert layout_markdown(pkg, (("core",), ("cli", "absent"))).splitlines()[2:] == [
        "| 1 | `cli.py` | The command line |  |", "| 0 | `core/` | The shared words | call |"]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--layout"]:
        # the page's table made afresh; with a folder (another checkout's bnprobe/), that tree's, by its own LAYERS
        root = Path(sys.argv[2]).resolve() if len(sys.argv) > 2 else PACKAGE
        their = ast.parse((root.parent / "tests" / "test_layers.py").read_text())
        layers = next(ast.literal_eval(n.value) for n in their.body if isinstance(n, ast.Assign)
                      and getattr(n.targets[0], "id", "") == "LAYERS")
        table = layout_markdown(root, layers)
        if len(sys.argv) > 2:
            print(table, end="")
        else:
            page = ARCHITECTURE.read_text()
            head, rest = page.split(_BEGIN, 1)
            ARCHITECTURE.write_text(head + _BEGIN + "\n\n" + table + "\n" + _END + rest.split(_END, 1)[1])
            print(f"wrote the layout into {ARCHITECTURE}")
    else:
        n, upward = arrows()
        print(f"{n} imports between bnprobe modules; layers, bottom to top: "
              + " < ".join("{" + ", ".join(names) + "}" for names in LAYERS))
        print(f"upward arrows: {len(upward)}", *upward, sep="\n")
