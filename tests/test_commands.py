"""The registry of commands (bnprobe.core.commands) is the one list: the command line registers exactly its
commands, the memory guard and the sweep read their figures from it, and each entry point and renderer exists."""

import pytest

from bnprobe.core.commands import COMMANDS, SWEEP_COMMANDS, command
from bnprobe.core.errors import BNProbeError


def test_the_command_line_registers_exactly_the_registry():
    from bnprobe.cli import app

    assert len(app.registered_commands) == len(COMMANDS)
    assert {c.name for c in app.registered_commands} == {c.name for c in COMMANDS}


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
def test_each_entry_point_and_renderer_is_a_function_of_its_module(cmd):
    assert callable(cmd.resolve("entry"))
    assert cmd.renderer is None or callable(cmd.resolve("renderer"))
    assert cmd.purpose and "\n" not in cmd.purpose


def test_the_public_entry_points_are_the_registrys():
    """A check's entry point exported by bnprobe is the function its command's registry entry names."""
    import bnprobe

    exported = {getattr(bnprobe, n) for n in bnprobe.__all__ if callable(getattr(bnprobe, n))}
    named = {c.resolve("entry") for c in COMMANDS}
    for name in ("compare_precision", "gradcheck", "doctor", "shrink", "scan_overflow", "find_stats_problems",
                 "check_fold", "trace_run", "identify"):
        assert getattr(bnprobe, name) in named & exported, name


def test_the_guard_and_the_sweep_read_the_registry():
    from bnprobe import guard
    from bnprobe.sweep import command as sweep_command
    from bnprobe.sweep import tasks

    assert guard.PER_ELEMENT == {**{c.name: c.per_element for c in COMMANDS if c.per_element}, "load": 16}
    assert set(guard.PER_RECORDED_ELEMENT) == {c.name for c in COMMANDS if c.per_recorded_element}
    # trace keeps to the float64 route: no numba in its estimate, where compare-precision (as many bytes a value) has it
    assert guard.run_bytes("compare-precision", 10**8) - guard.run_bytes("trace", 10**8) == guard.COMPILED_BYTES
    assert SWEEP_COMMANDS == ("compare-precision", "doctor", "overflow")
    assert set(tasks.SCORES) == set(SWEEP_COMMANDS)
    assert sweep_command.WRITES_BY_DEFAULT == ("compare-precision",)


def test_an_unknown_command_is_one_line():
    with pytest.raises(BNProbeError, match="unknown command 'compare'; the commands: compare-precision, "):
        command("compare")
