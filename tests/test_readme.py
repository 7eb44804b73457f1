"""The transcripts of the README and of every documentation page (docs/**/*.md) are the program's output: each
``$ bnprobe ...`` (or ``$ python examples/...``) block whose inputs ship with the repository is run here, in a fresh
folder (commands of one code block in order, in one folder), and its output compared with the page's line for line,
with what changes from run to run masked: timings, report folder names, free-memory figures; "..." on a page stands
for what an excerpt leaves out. A block is known by its first command, found on exactly one page; every block is
either run (RUN) or listed in NOT_RUN with the reason."""

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bnprobe.core.commands import COMMANDS as REGISTRY

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the pages whose transcripts are run: the README and every page of the documentation site
PAGES = [README, *sorted((ROOT / "docs").glob("**/*.md"))]

# the calibrated emulator beside the kernel it was identified from (a 32 x 64 x 56 x 56 input)
CALIBRATED = ('bnprobe compare-precision --adapters "emulated:fp16:variance=chan,tiles=32,y_formula=scale,fma=true,'
              'rsqrt=ascend950,backward_formula=ascend,ascend-950" --dtypes fp16 --shape 32,64,56,56 --mean 3 --std 2 '
              '--no-stress --no-budget --format md --out calibrated')
# torch's fp16 y on 4 M values per channel, named by identify's recipe for torch (its summation order)
NAMED = ("bnprobe compare-precision --adapters torch --dtypes fp16 --shape 1024,1,64,64 --no-stress --mode train "
         "--no-budget --format md --out named")
# the transcripts run here: a block's first command (the block's others follow it in the same folder), with what
# its inputs need (a DDP run's msprobe dumps are made by a session fixture; jax's runs in .ci/frameworks' jax
# environment; the 16 M-value inputs and rsqrt's fp32 sweep are marked slow; the adapters' listing where no other
# framework is installed)
# the commands, each with its page docs/commands/<command>.md
COMMANDS = tuple(c.name for c in REGISTRY)
RUN = {
    "bnprobe compare-precision": None,
    "bnprobe gradcheck --formula seed": None,
    "bnprobe identify --adapter torch --dtype fp16": "torch",
    "bnprobe identify --adapter torch --norm layer --dtype fp16": "torch",
    "bnprobe identify --adapter torch-compile --norm layer --dtype fp16": "torch",
    "bnprobe identify --adapter ascend-bnv3 --dtype fp16": None,
    "bnprobe dump --adapter ascend-950 --dtype fp16 --shape 8,32,14,14 --mean 3 --std 2 --out npu-call": None,
    'bnprobe doctor --adapter torch --dtype bf16 --params same | grep -E "^doctor|^FAIL" | cut -c1-330': "torch",
    "bnprobe overflow --accumulate fp16 --mean 100 --shape 8,4,8,8": None,
    "bnprobe overflow --adapter emulated:bf16-acc16:variance=naive --dtype bf16 --mean 7": None,
    "PYTHONPATH=. bnprobe doctor --adapter tests.checks.test_diagnosis:OnePassBiased --dtype fp32": None,
    "bnprobe shrink --adapter ascend-tbe --mean 100 --out shrunk": None,  # within its time budget: deterministic
    "bnprobe trace --policy fp16-acc16:variance=naive --shape 8,4,8,8 --mean 100": None,
    "bnprobe compare-precision --adapters dump:tests/data/msprobe_mindspore/L1-fp32 --no-budget": None,
    CALIBRATED: None,
    "bnprobe dump --adapter emulated:fp16:variance=naive,accumulate=fp16 --mean 30 --out bad-kernel": None,
    "bnprobe compare-precision --adapters dump:npu-dump --out report": "torch",  # its tensors are msprobe's .pt files
    "bnprobe doctor --adapter dump:npu-dump": "torch",  # its tensors are msprobe's .pt files
    "bnprobe overflow --adapter dump:npu-dump": "torch",  # its tensors are msprobe's .pt files
    "bnprobe compare-precision --adapters dump:capture-fp16 --no-budget --out report": None,
    "python examples/make_onnx_model.py .": "onnx",
    "bnprobe trace --shape 1,128,1024,1024": None,
    "bnprobe compare-precision --adapters dump:ddp-dump --out reports/ddp-sweep": "msprobe",
    "bnprobe doctor --adapter dump:syncbn-dump --out reports/syncbn-sweep": None,
    "bnprobe doctor --adapter jax --dtype fp32 --no-stability --convention torch": "flax",  # run by .ci/frameworks
    'bnprobe fold --weights layer.npz --folded exported.npz; echo "exit $?"': None,
    "python examples/monitor_cnn.py": "pyarrow",
    "python examples/monitor_cnn.py --step-on runs/monitor-cnn-on": "pyarrow",
    "python examples/monitor_transformer.py": "pyarrow",
    "bnprobe adapters": "torch",
    "bnprobe rsqrt --format fp32 --method magic --newton 0,1,2 --working fp64": None,
    "bnprobe compare-precision --adapters torch --dtypes fp16 --shape 4096,1,64,64 --no-stress --no-budget --format md "
    "--out big-torch": "torch",
    # the command pages' own examples
    "bnprobe compare-precision --adapters ascend-950,emulated:fp16-acc16 --dtypes fp16 --format md --out report": None,
    "bnprobe compare-precision --adapters torch --params same --no-budget --format md --out report": "torch",
    NAMED: "torch",
    "bnprobe dump --adapter ascend-tbe --mean 100 --out tbe-call": None,
    "bnprobe plot-stats --steps 40 --out stats": None,
    # a kernel that runs inference only, through each command that takes one
    "bnprobe doctor --adapter onnxruntime --dtype fp16 --params same": "onnxruntime",
    "bnprobe overflow --adapter onnxruntime --dtype fp16 --params same": "onnxruntime",
    'bnprobe gradcheck --adapter onnxruntime --dtype fp16 --params same 2>&1; echo "exit $?"': "onnxruntime",
    "bnprobe dump --adapter onnxruntime --dtype fp16 --params same --out ort-call": "onnxruntime",
    "PYTHONPATH=. bnprobe shrink --adapter tests.checks.bn_plugins:InferOnlyUsesBatch --shape 4,8,4,4 --out "
    "shrunk-infer": None,
    # the normalisation family's page: the built-in kernels that run LayerNorm, RMSNorm and GroupNorm
    "bnprobe compare-precision --norm layer --format md --out report-layer": "torch",
    "bnprobe compare-precision --norm rms --adapters torch,emulated:fp16-acc16 --dtypes fp16 --format md --out "
    "report-rms": "torch",
    "bnprobe compare-precision --norm group --num-groups 32 --adapters torch --format md --out report-group": "torch",
    "python examples/capture_transformer.py block-fp32 block-fp16": "torch",
    # doctor's default run on each of them: the defect each failure reproduces, or none
    "bnprobe doctor --norm layer --adapter torch": "torch",
    "bnprobe doctor --norm rms --adapter torch": "torch",
    "bnprobe doctor --norm group --num-groups 32 --adapter torch": "torch",
    # gradcheck's page: the default run of torch's LayerNorm, RMSNorm and GroupNorm
    "bnprobe gradcheck --norm layer --adapter torch": "torch",
    "bnprobe gradcheck --norm rms --adapter torch": "torch",
    "bnprobe gradcheck --norm group --num-groups 2 --adapter torch": "torch",
    "bnprobe compare-precision --adapters dump:norm-dump --no-budget --out report": "msprobe",
    # trace's and dump's pages: a family layer's stages, and its call recorded then judged from the dump
    "bnprobe trace --norm rms --policy fp16-acc16 --mean 30 --shape 2,16,1024": None,
    "bnprobe dump --norm layer --adapter torch --out ln-call": "torch",
    # overflow's and shrink's pages: a family layer scanned row by row, and its failing input shrunk and replayed
    "bnprobe overflow --norm rms --adapter emulated:fp16-acc16 --shape 2,4,64 --std 40": None,
    "bnprobe shrink --norm layer --adapter emulated:fp16-acc16 --shape 2,8,256 --mean 30 --out shrunk-layer": None,
    # the frameworks' own family layers: flax's GroupNorm, one-pass and two-pass (run by .ci/frameworks' jax stage)
    "bnprobe compare-precision --adapters jax,jax:fast_variance=false --norm group --num-groups 32 --dtypes fp32 "
    "--format md --out report-jax-group": "flax",
    # each command page's options, as its --help prints them
    **{f"bnprobe {command} --help": None for command in COMMANDS},
}
# the listing says what this machine has installed: the README's is of the test command's environment (torch, no
# other framework's distribution)
NOT_WITH = {"bnprobe adapters": ("jax", "flax", "tensorflow", "tensorflow-cpu", "keras", "paddlepaddle", "mindspore")}
SLOW = {"bnprobe rsqrt --format fp32 --method magic --newton 0,1,2 --working fp64",  # 26 s
        "bnprobe compare-precision --adapters torch --dtypes fp16 --shape 4096,1,64,64 --no-stress --no-budget "
        "--format md --out big-torch",  # 16 M values, torch's and the identified recipe's: 55 s
        NAMED,  # 4 M values, torch's, the careful bench's, the identified recipe's and its variants': 20 s
        "bnprobe identify --adapter torch-compile --norm layer --dtype fp16"}  # each probe compiles: 40 s
# the blocks that are shown but not run, each with the reason
NOT_RUN: dict[str, str] = {}
def _bad_inputs(folder: Path) -> None:
    """What the bad-input block names: a forged .npy (a header declaring 80 GB, 128 bytes in all), a file where a
    folder is wanted, and a report folder that holds a report."""
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (100000, 100000), }"
    header += " " * (128 - 10 - len(header) - 1) + "\n"
    (folder / "forged.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "mine").mkdir()
    (folder / "mine" / "compare.csv").write_text("an earlier run's\n")


def _syncbn_dump(folder: Path) -> None:
    """The SyncBN sweep's dumps: 2 steps of an emulated SyncBatchNorm whose merge ignores the ranks' counts, written
    per rank as tests/test_sweep.py writes them."""
    from tests.test_sweep import _syncbn_root

    _syncbn_root(folder / "syncbn-dump", "unweighted", steps=2)


def _fold_files(folder: Path) -> None:
    """fold's block: the built-in linear layer (seed 0) with its x, its fold stored in fp16 with the bias not
    scaled by A (b + B, the classic exporter bug), and the correct fold in fp16."""
    import numpy as np

    from bnprobe.checks.fold.layer import make_layer

    lay = make_layer("linear", seed=0)
    layer = dict(weight=lay.weight, gamma=lay.gamma, beta=lay.beta, running_mean=lay.running_mean,
                 running_var=lay.running_var, bias=lay.bias, x=lay.x, eps=np.array(lay.eps))
    np.savez(folder / "layer.npz", **layer)
    a = lay.gamma / np.sqrt(lay.running_var + lay.eps)
    shift = lay.beta - lay.running_mean * a
    w = (lay.weight * a[:, None]).astype(np.float16)
    np.savez(folder / "exported.npz", weight=w, bias=(lay.bias + shift).astype(np.float16))
    np.savez(folder / "fixed.npz", weight=w, bias=(lay.bias * a + shift).astype(np.float16))


SETUP = {"bnprobe trace --shape 1,128,1024,1024": _bad_inputs,
         'bnprobe fold --weights layer.npz --folded exported.npz; echo "exit $?"': _fold_files,
         "bnprobe doctor --adapter dump:syncbn-dump --out reports/syncbn-sweep": _syncbn_dump}
# blocks whose input is a session fixture's: (the fixture, the folder of it the README names, the name it has there)
FIXTURES = {"bnprobe compare-precision --adapters dump:ddp-dump --out reports/ddp-sweep":
            ("msprobe_ranks", "tensor", "ddp-dump"),  # a real 2-rank, 2-step DDP run's msprobe dumps
            # a real mix-level msprobe dump of a model's BatchNorm and its siblings (fp32)
            "bnprobe compare-precision --adapters dump:norm-dump --no-budget --out report":
            ("msprobe_family_dumps", "mix-fp32", "norm-dump")}
MASKS = [
    (re.compile(r"\b\d+\.\d+ s\b"), "<seconds> s"),
    (re.compile(r"reports/([A-Za-z0-9_.-]+)-\d{8}-\d{6}(-\d+)?"), r"reports/\1-<time>"),
    (re.compile(r"\d+(\.\d+)? [KMGT]iB of (memory )?available"), "<free> available"),
    (re.compile(r"the \d+(\.\d+)? [KMGT]iB (available|free)"), r"the <free> \2"),
]


def _installed(distribution: str) -> bool:
    """Whether a distribution is installed (by its metadata: msprobe's import puts tensorboard's stub in
    sys.modules["tensorflow"], which a module lookup would take for tensorflow)."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def mask(text: str) -> list[str]:
    out = []
    for line in text.rstrip("\n").splitlines():
        for rx, rep in MASKS:
            line = rx.sub(rep, line)
        out.append(line.rstrip())
    return out


def _page(path: Path) -> str:
    return str(path.relative_to(ROOT))


def page_blocks(path: Path) -> list[list[tuple[str, list[str]]]]:
    """Each fenced block's transcripts on one page: (command, its output lines). A fence may be indented (a block
    inside a list item): its lines are read without that indentation."""
    found, block, inside, indent = [], None, False, 0
    for line in path.read_text().splitlines():
        stripped = line.lstrip(" ")
        if stripped.startswith("```"):
            if inside and block:
                found.append(block)
            inside, block, indent = not inside, [], len(line) - len(stripped)
            continue
        if not inside:
            continue
        line = line[indent:] if line[:indent].strip() == "" else line
        if line.startswith("$ "):
            block.append((line[2:], []))
        elif block:
            block[-1][1].append(line)
    return found


def blocks() -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """Every page's fenced blocks with transcripts: (the page, the block)."""
    return [(_page(path), b) for path in PAGES for b in page_blocks(path)]


def chosen():
    for page, b in blocks():
        if b[0][0] in RUN:
            yield pytest.param(b, id=f"{page}:{b[0][0][:60]}", marks=[pytest.mark.slow] if b[0][0] in SLOW else [])


def run(command: str, cwd: Path) -> str:
    """The command as a user types it, in ``cwd``: ``bnprobe`` is the installed command (which, unlike
    ``python -m``, does not search the current folder), stdout then stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("BNPROBE_MAX_MEMORY", "PYTHONPATH")}
    env["COLUMNS"] = "250"
    # the bnprobe that runs is this checkout's, also where the environment's editable install is another checkout's
    # (a worktree's tests run with its venv); a page's own PYTHONPATH=. keeps it behind the current folder
    env["PYTHONPATH"] = str(ROOT)
    script = Path(sys.executable).parent / "bnprobe"
    exe = str(script) if script.is_file() else f"{sys.executable} -m bnprobe"
    cmd = re.sub(r"^((?:\w+=\S*\s+)*)bnprobe\b", lambda m: m.group(1) + exe, command)
    cmd = re.sub(r"^PYTHONPATH=\.(\s)", lambda m: f"PYTHONPATH=.:{ROOT}{m.group(1)}", cmd)
    cmd = cmd.replace("python examples/", f"{sys.executable} {ROOT}/examples/")
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return r.stdout + r.stderr


def test_every_chosen_transcript_is_on_exactly_one_page():
    firsts = [b[0][0] for _, b in blocks()]
    missing = set(RUN) - set(firsts)
    assert not missing, missing
    twice = {c for c in RUN if firsts.count(c) > 1}
    assert not twice, twice


def test_every_transcript_is_run_or_says_why_not():
    """Every fenced block of ``$ ...`` commands on any page runs here (RUN), or NOT_RUN gives the reason; neither
    list names a block no page has."""
    unlisted = [f"{page}: $ {b[0][0]}" for page, b in blocks() if b[0][0] not in RUN and b[0][0] not in NOT_RUN]
    assert not unlisted, "\n".join(unlisted)
    assert not set(RUN) & set(NOT_RUN)
    firsts = {b[0][0] for _, b in blocks()}
    assert set(NOT_RUN) <= firsts, set(NOT_RUN) - firsts
    assert all(reason.strip() for reason in NOT_RUN.values())


def matches(got: list[str], expected: list[str]) -> bool:
    """``got`` against the README's lines, where a line "..." stands for any lines (an excerpt) and "..." inside a
    line for any text."""
    pats = [None if e.strip() == "..." else re.compile(".*?".join(re.escape(p) for p in e.split("...")) + r"\Z")
            for e in expected]

    def fit(i: int, j: int) -> bool:
        if i == len(pats):
            return j == len(got)
        if pats[i] is None:
            return any(fit(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and pats[i].match(got[j]) is not None and fit(i + 1, j + 1)

    return fit(0, 0)


def test_every_image_a_page_shows_is_in_the_repository():
    shown = [(path.parent / image) for path in PAGES
             for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", path.read_text())]
    assert shown and all(image.is_file() for image in shown), shown


@pytest.mark.parametrize("block", list(chosen()))
def test_readme_transcript(block, tmp_path, request):
    need = RUN[block[0][0]]
    if need:
        pytest.importorskip(need)
    present = [m for m in NOT_WITH.get(block[0][0], ()) if _installed(m)]
    if present:
        pytest.skip(f"{present[0]} is installed: the README lists the adapters of an environment without it")
    if block[0][0] in FIXTURES:
        fixture, sub, name = FIXTURES[block[0][0]]
        root = request.getfixturevalue(fixture)[0]
        (tmp_path / name).symlink_to(root / sub)
    # the repository's inputs, as the README's commands name them (the dumps: from examples/, as the README says)
    for link, target in (("tests", "tests"), ("examples", "examples"), ("npu-dump", "examples/npu-dump"),
                         ("capture-fp16", "examples/capture-fp16")):
        (tmp_path / link).symlink_to(ROOT / target)
    if block[0][0] in SETUP:
        SETUP[block[0][0]](tmp_path)
    for command, expected in block:
        got = mask(run(command, tmp_path))
        assert matches(got, mask("\n".join(expected))), f"$ {command}\n" + "\n".join(got)
