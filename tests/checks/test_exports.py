"""The checks' entry points are public names of ``bnprobe.checks`` and ``bnprobe``, loaded on first use."""

import subprocess
import sys


def test_entry_points_are_the_functions_of_their_modules():
    import bnprobe
    import bnprobe.checks as checks
    from bnprobe.checks import compare, diagnosis, fold, gradients, overflow, shrinking, stages, stats

    expected = {"compare_precision": compare.compare_precision, "gradcheck": gradients.gradcheck,
                "gradcheck_recorded": gradients.gradcheck_recorded, "check_formula": gradients.check_formula,
                "doctor": diagnosis.doctor, "doctor_recorded": diagnosis.doctor_recorded,
                "shrink": shrinking.shrink, "scan_overflow": overflow.scan,
                "scan_overflow_recorded": overflow.scan_recorded, "find_stats_problems": stats.find,
                "check_fold": fold.check_fold, "trace_run": stages.trace_run}
    for name, fn in expected.items():
        assert getattr(checks, name) is fn, name
        assert name in checks.__all__
        if name in bnprobe.__all__:
            assert getattr(bnprobe, name) is fn, name
    assert {"compare_precision", "gradcheck", "doctor", "shrink", "scan_overflow", "find_stats_problems",
            "check_fold"} <= set(bnprobe.__all__)
    assert sorted(checks.__all__) == sorted(set(checks.__all__)) and set(checks.__all__) == set(dir(checks)) & set(
        checks.__all__)


def test_importing_checks_loads_no_check_module():
    code = ("import sys, bnprobe.checks\n"
            "assert not [m for m in sys.modules if m.startswith('bnprobe.checks.')], sorted(sys.modules)\n"
            "assert 'pandas' not in sys.modules and 'numpy' not in sys.modules\n"
            "from bnprobe.checks import diagnosis\n"  # a submodule is still importable by its name
            "assert diagnosis.__name__ == 'bnprobe.checks.diagnosis'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
