"""Output folders: checked before any work, all-or-nothing, never over a file without --force, the user's
permissions, unique default folders."""

import os
import stat
import subprocess
import sys

import pytest

from bnprobe._files import atomic_write_text, file_mode, output_dir
from bnprobe.cli import main
from bnprobe.core.errors import BNProbeError


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_transaction_commits_all_or_nothing(tmp_path):
    with output_dir(tmp_path / "a" / "b", "x") as sink:
        sink.write_text("one.txt", "1")
        assert tree(tmp_path / "a" / "b") != ["one.txt"]  # staged under a temporary name until commit
    assert (tmp_path / "a" / "b" / "one.txt").read_text() == "1"
    with pytest.raises(RuntimeError):
        with output_dir(tmp_path / "c" / "d", "x") as sink:
            sink.write_text("one.txt", "1")
            raise RuntimeError("the run failed")
    assert not (tmp_path / "c").exists()  # the folders it created are gone too


def test_never_overwrites_without_force(tmp_path):
    (tmp_path / "r.csv").write_text("mine")
    sink = output_dir(tmp_path, "x")
    with pytest.raises(BNProbeError, match="refusing to overwrite"):
        sink.claim("r.csv")
    sink.write_text("other.csv", "x")
    with pytest.raises(BNProbeError):
        sink.write_text("r.csv", "theirs")
    sink.discard()
    assert tree(tmp_path) == ["r.csv"] and (tmp_path / "r.csv").read_text() == "mine"
    forced = output_dir(tmp_path, "x", force=True)
    forced.write_text("r.csv", "new")
    forced.commit()
    assert (tmp_path / "r.csv").read_text() == "new"


def test_files_get_the_users_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        import bnprobe._files as files

        files._UMASK = None
        assert file_mode() == 0o640
        atomic_write_text(tmp_path / "a.txt", "x")
        with output_dir(tmp_path / "o", "x") as sink:
            sink.write_text("b.txt", "y")
        for p in (tmp_path / "a.txt", tmp_path / "o" / "b.txt"):
            assert stat.S_IMODE(p.stat().st_mode) == 0o640, p
    finally:
        os.umask(old)
        files._UMASK = None
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "same.txt", "x")
    assert stat.S_IMODE((tmp_path / "same.txt").stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)


def test_default_folders_are_unique_for_simultaneous_runs(tmp_path):
    code = ("import sys; from bnprobe._files import output_dir; "
            "print(output_dir(None, 'same', root=sys.argv[1]).path)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "reports")], stdout=subprocess.PIPE,
                              text=True) for _ in range(6)]
    paths = [p.communicate()[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(paths)) == 6 and all(os.path.isdir(p) for p in paths)


@pytest.mark.parametrize("make, why", [
    (lambda t: (t / "f").write_text("x") and t / "f", "is a file, not a folder"),
    (lambda t: (t / "f").write_text("x") and t / "f" / "sub", "f is a file"),
    (lambda t: t / ("n" * 300), "name too long"),
])
def test_bad_out_is_one_line_before_work(capsys, tmp_path, make, why):
    out = make(tmp_path)
    before = tree(tmp_path)
    for argv in (["compare-precision", "--shape", "2,3,4,4", "--no-stress", "--no-budget"],
                 ["overflow", "--shape", "2,3,4,4"], ["gradcheck", "--shape", "2,3,4,4"], ["doctor"],
                 ["fold"], ["rsqrt", "--format", "fp16"], ["plot-stats", "--steps", "2"],
                 ["shrink", "--adapter", "emulated", "--shape", "2,3,4,4"],
                 ["dump", "--adapter", "emulated", "--shape", "2,3,4,4"]):
        code, _, err = run(capsys, *argv, "--out", str(out))
        assert code == 2 and err.count("\n") == 1 and why in err, (argv, err)
        assert tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_out(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    code, _, err = run(capsys, "overflow", "--shape", "2,3,4,4", "--out", str(ro / "o"))
    assert code == 2 and "is not writable" in err


def test_existing_report_refused_up_front_then_forced(capsys, tmp_path):
    args = ["compare-precision", "--shape", "2,3,4,4", "--no-stress", "--no-budget", "--dtypes", "fp16",
            "--format", "csv", "--out", str(tmp_path)]
    (tmp_path / "compare.csv").write_text("mine")
    code, out, err = run(capsys, *args)
    assert code == 2 and "compare.csv exists" in err and out == ""
    assert (tmp_path / "compare.csv").read_text() == "mine" and tree(tmp_path) == ["compare.csv"]
    code, out, _ = run(capsys, *args, "--force")
    assert code in (0, 1) and (tmp_path / "compare.csv").read_text() != "mine"
    assert sorted(tree(tmp_path)) == ["budget.csv", "channels.csv", "compare.csv"]


def test_plot_stats_no_longer_replaces_the_users_files(capsys, tmp_path):
    (tmp_path / "stats.csv").write_text("mine")
    (tmp_path / "index.html").write_text("mine too")
    code, _, err = run(capsys, "plot-stats", "--steps", "3", "--out", str(tmp_path))
    assert code == 2 and "stats.csv exists" in err
    assert tree(tmp_path) == ["index.html", "stats.csv"]
    assert (tmp_path / "stats.csv").read_text() == "mine"


def test_a_failing_run_leaves_no_report_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "compare-precision", "--shape", "2,3,4,4", "--no-stress", "--dtypes", "fp99")
    assert code == 2
    assert not (tmp_path / "reports").exists()


def test_shrink_refuses_up_front_and_forces(capsys, tmp_path):
    (tmp_path / "x.npy").write_text("mine")
    args = ["shrink", "--adapter", "ascend-tbe", "--mean", "100", "--shape", "4,8,8,8", "--out", str(tmp_path)]
    code, out, err = run(capsys, *args)
    assert code == 2 and "x.npy exists" in err and out == ""
    assert tree(tmp_path) == ["x.npy"] and (tmp_path / "x.npy").read_text() == "mine"
    code, out, err = run(capsys, *args, "--force")
    assert code == 0, err
    assert {"x.npy", "shrink.json", "dump", "dump/bnprobe-dump.json", "dump/tensors.npz"} == set(tree(tmp_path))
    assert stat.S_IMODE((tmp_path / "shrink.json").stat().st_mode) == file_mode()


def test_report_json_is_the_text_of_jsons_own_indenting_encoder():
    """dumps_json writes each container of plain values with json's C encoder: the text is what
    ``json.dumps(indent=2, default=str)`` (json's pure-Python indenting encoder, the oracle) writes, for nested,
    empty, non-ASCII and line-broken strings, numpy values, NaN/inf, tuples, integer keys and unknown objects."""
    import json

    import numpy as np

    from bnprobe._files import dumps_json, to_jsonable

    class Named:
        def __str__(self):
            return "named, 2\n"

    docs = [{}, [], {"a": {}, "b": []}, [1, [2, [3, {}]], {"x": "a\nb\u00e9\",", "y": None, "z": True}],
            {"k": np.float32(1.5), "n": float("nan"), "i": -float("inf"), "t": (1, 2.5), 3: "int key", "o": Named()},
            {"rows": [{"a": 1, "b": "x,\n  y"}, {"a": np.int64(2), "b": np.array([1.0, np.nan])}], "s": "plain"},
            "text", 1.0, None, [float("inf")], {"deep": {"deeper": [{"a": [[]]}, [], {}]}}]
    for doc in docs:
        assert dumps_json(doc) == json.dumps(to_jsonable(doc), indent=2, default=str), doc
