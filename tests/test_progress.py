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
