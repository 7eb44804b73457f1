"""The progress bar: drawn on a terminal, silent when piped."""

import io

from bnprobe._progress import Progress


def test_progress_steps_and_closes_as_a_context_manager():
    s = io.StringIO()
    with Progress("shrink", stream=s, enabled=True) as bar:
        tick = bar.steps(2)
        for _ in range(5):  # more steps than announced stay at 100 %
            tick("step")
    text = s.getvalue()
    assert "100.0%" in text and text.endswith("\n") and "shrink [" in text
    quiet = io.StringIO()
    with Progress("x", stream=quiet) as bar:  # a StringIO is not a terminal: nothing drawn
        bar.steps(3)()
    assert quiet.getvalue() == ""


def test_the_estimate_leaves_out_the_first_step():
    """A first step that takes long (start-up, compiling kernels) does not inflate the time left: the estimate is
    the rate since it completed, and before that the bar says so."""
    import io

    from bnprobe._progress import Progress

    out = io.StringIO()
    p = Progress("x", stream=out, enabled=True)
    clock = [0.0]
    import bnprobe._progress as mod

    real = mod.time.monotonic
    mod.time.monotonic = lambda: clock[0]
    try:
        p.start = 0.0
        clock[0] = 0.5
        p(0, 100)
        assert "after the first step (it may compile kernels)" in out.getvalue()
        clock[0] = 60.0  # the first step took a minute (compiling)
        p(1, 100)
        assert out.getvalue().rstrip().endswith("(it may compile kernels)")
        clock[0] = 61.0  # then one second for ten steps: 0.1 s a step, 89 steps left
        p(11, 100)
        assert out.getvalue().rstrip().endswith("eta    8.9s")
    finally:
        mod.time.monotonic = real
