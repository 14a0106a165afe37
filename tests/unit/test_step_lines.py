"""--no-progress shows the loop's progress as lines: after the first and the last step, and between them at
most one every StepLines.every_s (slimtune/run/step_lines.py; a --no-progress run sat silent to its end)."""

import pytest

from slimtune.run.step_lines import StepLines

pytestmark = pytest.mark.quick


def run_steps(lines: StepLines, clock: list[float], steps: range, seconds_a_step: float) -> None:
    for step in steps:
        clock[0] += seconds_a_step
        lines.set_postfix(loss=f"{1 / step:.4f}")
        lines.update(1)


def test_lines_come_after_the_first_and_last_step_and_at_most_every_interval():
    clock, said = [0.0], []
    run_steps(StepLines(10, 0, said.append, every_s=30.0, clock=lambda: clock[0]), clock, range(1, 11), 7.0)
    # steps at 7, 14, ... 70 s: the first, then whenever 30 s have passed since the last line, and the last
    assert said == ["step 1/10 loss=1.0000", "step 6/10 loss=0.1667", "step 10/10 loss=0.1000"]


def test_a_resumed_run_says_its_first_step_after_the_checkpoint():
    clock, said = [0.0], []
    run_steps(StepLines(6, 4, said.append, clock=lambda: clock[0]), clock, range(5, 7), 1.0)
    assert said == ["step 5/6 loss=0.2000", "step 6/6 loss=0.1667"]
