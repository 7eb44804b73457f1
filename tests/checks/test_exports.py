"""The checks' entry points are public names of ``bnprobe`` (its one ``__all__``), loaded on first use;
``bnprobe.checks`` holds one package per command and imports none of them."""

import subprocess
import sys


def test_entry_points_are_the_functions_of_their_modules():
    import bnprobe
    from bnprobe.checks.compare import precision
    from bnprobe.checks.doctor import diagnosis
    from bnprobe.checks.fold import layer
    from bnprobe.checks.gradcheck import gradients
    from bnprobe.checks.identify import search
    from bnprobe.checks.overflow import scan
    from bnprobe.checks.plot_stats import stats
    from bnprobe.checks.shrink import shrinking
    from bnprobe.checks.trace import stages

    expected = {"compare_precision": precision.compare_precision, "gradcheck": gradients.gradcheck,
                "check_formula": gradients.check_formula, "doctor": diagnosis.doctor, "shrink": shrinking.shrink,
                "scan_overflow": scan.scan, "find_stats_problems": stats.find, "check_fold": layer.check_fold,
                "trace_run": stages.trace_run, "identify": search.identify}
    for name, fn in expected.items():
        assert getattr(bnprobe, name) is fn, name
        assert name in bnprobe.__all__
    assert sorted(bnprobe.__all__) == sorted(set(bnprobe.__all__))
    assert set(bnprobe.__all__) <= set(dir(bnprobe))


def test_a_command_package_is_not_shadowed_by_an_entry_point():
    """``bnprobe.checks.doctor`` is the doctor package whichever was imported first (an entry point of the same name
    would make it depend on import order)."""
    code = ("import bnprobe\n"
            "bnprobe.doctor, bnprobe.identify, bnprobe.shrink, bnprobe.gradcheck\n"
            "from bnprobe.checks import doctor, gradcheck, identify, shrink\n"
            "assert all(type(m).__name__ == 'module' for m in (doctor, gradcheck, identify, shrink))\n"
            "assert callable(bnprobe.doctor) and bnprobe.doctor.__module__ == 'bnprobe.checks.doctor.diagnosis'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_importing_checks_loads_no_check_module():
    code = ("import sys, bnprobe.checks\n"
            "assert not [m for m in sys.modules if m.startswith('bnprobe.checks.')], sorted(sys.modules)\n"
            "assert 'pandas' not in sys.modules and 'numpy' not in sys.modules\n"
            "from bnprobe.checks.doctor import diagnosis\n"
            "assert diagnosis.__name__ == 'bnprobe.checks.doctor.diagnosis'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
