import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest


@pytest.fixture(scope="session")
def msprobe_dumps(tmp_path_factory):
    """(root, manifest): real msprobe dumps of BatchNorm calls and their ground truth (tests/msprobe_dumps.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("msprobe")  # the bare package only; msprobe.pytorch is imported in the generator subprocess
    import json

    from msprobe_dumps import MANIFEST, make_dumps

    root = tmp_path_factory.mktemp("msprobe")
    make_dumps(root)
    return root, json.loads((root / MANIFEST).read_text())
