import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest

from bnprobe.guard import tune_process

# the suite's processes run compiled kernels in-process, two workers on two cores: tuned as a command's process is
# (with spinning OpenMP threads the compiled-route matrices took 6x as long), from the start rather than from the
# first in-process command on
tune_process()
# the suite's large calls compile in-process on first use, as numba does by itself: no background warm-up
# processes (bnprobe.compiled.jit) outliving a test run; tests/test_warm_up.py tests that mode
os.environ.setdefault("BNPROBE_WARM_UP", "foreground")


def made_once(tmp_path_factory, name, make):
    """The folder ``name`` filled by ``make(folder)`` once in the whole run: pytest-xdist's workers share the parent
    of their temporary folders, and the first worker to ask makes it under a file lock while another that asks
    waits for it (each worker generated its own copy of every dump set before: the same subprocess run twice)."""
    from filelock import FileLock  # (torch's requirement: these fixtures need torch)

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(f"{root}.lock"):
        done = root.parent / f"{name}.done"
        if not done.is_file():
            if root.exists():  # a half-made folder (its maker failed): made anew
                shutil.rmtree(root)
            root.mkdir()
            make(root)
            done.touch()
    return root


@pytest.fixture(scope="session")
def msprobe_dumps(tmp_path_factory):
    """(root, manifest): real msprobe dumps of BatchNorm calls and their ground truth (tests/msprobe_dumps.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("msprobe")  # the bare package only; msprobe.pytorch is imported in the generator subprocess
    import json

    from msprobe_dumps import MANIFEST, make_dumps

    root = made_once(tmp_path_factory, "msprobe", make_dumps)
    return root, json.loads((root / MANIFEST).read_text())


@pytest.fixture(scope="session")
def msprobe_family_dumps(tmp_path_factory):
    """(root, manifest): real msprobe dumps of the normalisation family's calls beside a BatchNorm, and torch's values
    for every call (tests/msprobe_family_dumps.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("msprobe")  # the bare package only; msprobe.pytorch is imported in the generator subprocess
    import json

    from msprobe_family_dumps import MANIFEST, make_family_dumps

    root = made_once(tmp_path_factory, "msprobe-family", make_family_dumps)
    return root, json.loads((root / MANIFEST).read_text())


def generate_ranks(tmp_path_factory, name, steps, world, statistics):
    """(root, manifest): real msprobe dumps of a DDP training run on ``world`` gloo processes over ``steps`` steps
    (tests/msprobe_ranks.py), with torch's values for every call, in the run's folder ``name`` (made once)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("msprobe")  # the bare package only; msprobe.pytorch is imported in the worker processes
    import json

    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed's gloo backend is unavailable in this torch build: no multi-rank dumps")
    from msprobe_ranks import MANIFEST, make_rank_dumps

    root = made_once(tmp_path_factory, name, lambda r: make_rank_dumps(r, steps, world, statistics=statistics))
    return root, json.loads((root / MANIFEST).read_text())


@pytest.fixture(scope="session")
def msprobe_ranks(tmp_path_factory):
    """(root, manifest): 2 ranks x 2 steps of real msprobe dumps, a tensor and a statistics dump of one run."""
    return generate_ranks(tmp_path_factory, "msprobe-ranks", 2, 2, True)



@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n 2`` (the README's command) schedules by work stealing: a worker that runs out of tests takes half of the
    other's queue. xdist's default (load) keeps a queue of at least two tests per worker to the end, so one worker
    could sit idle while the other still had two of the long transcript or identify tests queued."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None
