"""No long wait is silent. The planner shows a bar on a terminal and one line otherwise while it
weighs plans, counting exactly the plans it weighs (none when the estimate cache holds them all; the
worker's share too: tests/e2e/test_plan_worker.py). Tokenizing a dataset and the eval command's work
(slimtune/progress.py) show nothing for work over within 2 s, then a bar on a terminal, or on a file
a line then and at most every 30 s."""

import io
import json
import sys
import threading
import time

import pytest

from conftest import tiny_config
from slimtune import progress
from slimtune.config import DataConfig
from slimtune.data import dataset
from slimtune.planning import planner
from slimtune.planning.weighing import Weighing


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_file_gets_one_line_saying_how_many_plans_and_nothing_per_plan():
    stream = io.StringIO()
    with Weighing("slimtune plan", ", and the longest sequence each fits", stream=stream, delay=0) as weighing:
        weighing.start(3)
        for _ in range(3):
            weighing.tick()
    assert stream.getvalue() == ("slimtune plan: weighing 3 plans on fake tensors, and the longest sequence each"
                                 " fits\n")
    assert (weighing.done, weighing.total) == (3, 3)


@pytest.mark.parametrize("total, exact, said", [(1, True, "weighing 1 plan on"), (4, False, "weighing at most 4 plans")])
def test_the_line_counts_plans_as_they_are(total, exact, said):
    stream = io.StringIO()
    Weighing("x", stream=stream, delay=0).start(total, exact)
    assert said in stream.getvalue()


def test_a_terminal_gets_a_bar_that_counts_each_plan_and_is_wiped():
    stream = Terminal()
    weighing = Weighing("slimtune plan", stream=stream, delay=0)
    weighing.start(2)
    weighing.tick()
    weighing.tick()
    weighing.close()
    shown = stream.getvalue()  # (tqdm redraws at most every 0.1 s: the ticks above came sooner)
    assert "slimtune plan: weighing plans" in shown and "0/2" in shown and weighing.done == 2
    assert shown.endswith("\r"), "the bar is left on the screen"  # leave=False: wiped, the table follows
    from tqdm import tqdm  # a thread lock guards the bars, not a multiprocessing one (progress.thread_lock_for_bars)

    assert isinstance(tqdm.get_lock(), type(threading.RLock()))


def test_nothing_is_shown_when_asked_for_nothing_nothing_is_left_or_all_is_over_within_the_delay():
    for weighing in (Weighing("x", show=False, stream=Terminal(), delay=0), Weighing("x", stream=io.StringIO(), delay=0),
                     Weighing("x", stream=Terminal()), Weighing("x", stream=io.StringIO())):
        weighing.start(0 if weighing.delay == 0 and weighing.show else 5)
        weighing.tick()
        weighing.close()
        assert weighing.stream.getvalue() == ""


def test_a_slow_first_plan_is_not_a_silent_wait():
    """The line comes when the delay has passed, from a timer, while the first plan is still weighed."""
    stream = io.StringIO()
    weighing = Weighing("slimtune plan", stream=stream, delay=0.05)
    weighing.start(2)
    for _ in range(200):  # up to 10 s
        if stream.getvalue():
            break
        time.sleep(0.05)
    weighing.close()
    assert stream.getvalue() == "slimtune plan: weighing 2 plans on fake tensors\n" and weighing.done == 0


def test_the_planner_counts_every_plan_it_weighs_and_none_it_finds_cached():
    model_config, base = tiny_config(num_hidden_layers=3), planner.planning_config("lora")
    machine = planner.Machine.named("1GiB")
    stream = io.StringIO()
    weighing = Weighing("slimtune plan", stream=stream, delay=0)
    results = planner.plan(model_config, base, machine, 1, 40, progress=weighing)
    assert weighing.done == weighing.total == len(results) > 1
    # (then, on a slow machine, the count every 30 s)
    assert stream.getvalue().splitlines()[0] == f"slimtune plan: weighing {len(results)} plans on fake tensors"
    again = Weighing("slimtune plan", stream=io.StringIO(), delay=0)
    planner.plan(model_config, base, machine, 1, 40, progress=again)  # every estimate is in the cache now
    assert again.total == again.done == 0 and again.stream.getvalue() == ""


def test_settling_an_open_setting_says_how_many_plans_it_may_weigh_and_counts_none_cached():
    """chunk.n_chunks left open: a bisection over the counts, announced as at most so many plans."""
    from slimtune.engines import settings
    from slimtune.engines.chunk import state

    base = settings.load(None, ["engine=chunk", "chunk.n_chunks=0"],
                         base=planner.to_dict(planner.planning_config("full")))
    candidates = state.open_settings(base)
    stream = io.StringIO()
    weighing = Weighing("settling chunk.n_chunks", stream=stream, delay=0)
    model_config, machine = tiny_config(num_hidden_layers=2), planner.Machine.named("1GiB")
    planner.first_fitting(model_config, base, candidates, machine, weighing)
    assert 1 <= weighing.done <= weighing.total < len(candidates)
    assert stream.getvalue().splitlines()[0] == (f"settling chunk.n_chunks: weighing at most {weighing.total} plans on"
                                                 " fake tensors")
    # The same bisection again meets only cached plans: none counted, and over within the delay, so silent.
    again = Weighing("settling chunk.n_chunks", stream=io.StringIO())
    planner.first_fitting(model_config, base, candidates, machine, again)
    assert again.done == 0 and again.stream.getvalue() == ""


class Clock:
    """Seconds that pass as the caller asks: `step` a reading."""

    def __init__(self, step: float):
        self.now, self.step = -step, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_lines_begin_after_the_delay_and_then_come_at_most_every_30_s():
    stream = io.StringIO()
    items = list(range(100))
    seen = list(progress.shown(items, "tokenizing x.jsonl", "record", "lines", stream=stream, delay=0, clock=Clock(1.0)))
    assert seen == items
    # the clock reads 0 as the delay ends (here at once), then 1, 2, ... as each item ends
    assert stream.getvalue().splitlines() == ["tokenizing x.jsonl: 0/100 records", "tokenizing x.jsonl: 30/100 records",
                                              "tokenizing x.jsonl: 60/100 records", "tokenizing x.jsonl: 90/100 records"]


def test_a_bar_counts_the_items_and_is_wiped_and_plurals_are_named():
    stream = Terminal()
    assert list(progress.shown(range(3), "eval: loss", "batch", "bar", "batches", stream=stream, delay=0)) == [0, 1, 2]
    assert "eval: loss" in stream.getvalue() and "0/3" in stream.getvalue() and stream.getvalue().endswith("\r")
    stream = io.StringIO()
    list(progress.shown(range(3), "eval: loss", "batch", "lines", "batches", stream=stream, delay=0))
    assert stream.getvalue() == "eval: loss: 0/3 batches\n"


def test_quick_work_and_none_show_nothing():
    for mode, stream in (("lines", io.StringIO()), ("bar", Terminal()), ("none", Terminal())):
        assert list(progress.shown(range(5), "x", "record", mode, stream=stream)) == list(range(5))
        assert stream.getvalue() == "", mode


def test_a_bar_is_asked_for_only_on_a_terminal_and_nothing_from_another_rank(monkeypatch):
    assert progress.mode_for(bar=True) == "lines"  # pytest's stderr is not a terminal
    assert progress.mode_for(bar=False) == "lines"
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert progress.mode_for(bar=True) == "bar" and progress.mode_for(bar=False) == "lines"
    assert progress.mode_for(bar=True, show=False) == "none"
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, some daemons
    assert progress.mode_for(bar=True) == "lines" and Weighing("x", show=False).done == 0


def test_tokenizing_a_dataset_is_shown_once_it_takes_a_while(tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "response": f" {i + 1}"}) + "\n" for i in range(40)))
    from slimtune import demo

    tokenizer = AutoTokenizer.from_pretrained(str(demo.ASSETS / "base"))
    cfg = DataConfig(path=str(path), max_length=32)
    dataset.load_splits(cfg, tokenizer, 0)  # "none", the default
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    dataset.load_splits(cfg, tokenizer, 0, shown="lines")
    assert capsys.readouterr().err == f"tokenizing {path}: 0/40 records\n"


def test_a_large_folder_is_said_before_it_is_written_checked_or_read_and_a_small_one_is_not(tmp_path, monkeypatch,
                                                                                            capsys):
    from slimtune.store import checkpoint

    with checkpoint.atomic_folder(tmp_path / "small", needed=progress.LARGE_FOLDER - 1) as tmp:
        (tmp / "a").write_bytes(b"x")
    assert capsys.readouterr().err == ""
    with checkpoint.atomic_folder(tmp_path / "checkpoint-5", needed=3 * 2**30) as tmp:
        (tmp / "a").write_bytes(b"x")
    assert capsys.readouterr().err == f"writing {tmp_path / 'checkpoint-5'} (3.0 GiB)\n"
    sums = checkpoint.file_sums(tmp_path / "checkpoint-5")
    assert checkpoint.files_damage(tmp_path / "checkpoint-5", sums) is None
    assert capsys.readouterr().err == ""  # one byte
    monkeypatch.setattr(progress, "LARGE_FOLDER", 1)
    assert checkpoint.files_damage(tmp_path / "checkpoint-5", sums) is None
    assert capsys.readouterr().err == f"checking {tmp_path / 'checkpoint-5'} (1 B)\n"


def test_a_large_checkpoint_is_said_as_it_is_written_and_checked(tmp_path, monkeypatch, capsys):
    import torch

    from conftest import engine_config
    from slimtune.config import TrainConfig
    from slimtune.engines.resident import ResidentEngine
    from slimtune.model.stack import Stack
    from slimtune.store import checkpoint
    from test_slide import batches, model_of

    engine = ResidentEngine(Stack(model_of()), engine_config(TrainConfig(steps=2, batch_size=2)), torch.device("cpu"),
                            "fp32")
    engine.step(batches(300, 0, 2))
    monkeypatch.setattr(progress, "LARGE_FOLDER", 1)  # the tiny checkpoint stands for a large one
    saved = checkpoint.save(tmp_path, 1, engine.state_dict(), {"epoch": 0, "cursor": 2}, keep_last=1)
    found, damaged = checkpoint.latest_intact(tmp_path)
    size = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file() and p.name != "meta.json")
    assert found == saved and not damaged and checkpoint.written_bytes(found) == size > 0
    said = [line.rsplit(" (", 1)[0] for line in capsys.readouterr().err.splitlines()]
    assert said == [f"writing {saved}", f"checking {saved}"]  # train's resume says "reading" (rank 0 only)


def test_a_resumed_run_says_it_reads_a_large_checkpoint(tmp_path, tokenizer, monkeypatch, capsys):
    from pathlib import Path

    from conftest import save_tiny_model, write_jsonl
    from slimtune import cli
    from slimtune.store import checkpoint

    save_tiny_model(tmp_path / "model", tokenizer)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i} + 1 =", "response": f" {i + 1}"} for i in range(16)])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(progress, "LARGE_FOLDER", 1)  # the tiny checkpoints stand for large ones
    run = ["train", "--no-progress", "model=model", "data.path=train.jsonl", "data.max_length=16",
           "train.batch_size=4", "train.save_every=1", "lora.rank=4", "output_dir=out"]
    assert cli.main([*run, "train.steps=1"]) == 0
    capsys.readouterr()
    assert cli.main([*run, "train.steps=2"]) == 0
    said = [line.rsplit(" (", 1)[0] for line in capsys.readouterr().err.splitlines()]
    first, second = (Path("out/checkpoints") / f"{checkpoint.PREFIX}{k:08d}" for k in (1, 2))
    assert said == [f"checking {first}", f"reading {first}", f"writing {second}", "writing out/adapter"]


def test_eval_answers_are_counted_in_batches(tokenizer, monkeypatch, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from slimtune.serve import inference

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tokenizer)))
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    prompts = [tokenizer(f"{i} + 1 =")["input_ids"] for i in range(3)]
    answers = inference.greedy_answers(model, tokenizer, torch.device("cpu"), prompts, 2, batch_size=2, shown="lines")
    assert len(answers) == 3 and capsys.readouterr().err == "eval: answers: 0/2 batches\n"


def test_a_bar_on_a_terminal_names_what_runs_between_steps(monkeypatch):
    from slimtune import train
    from slimtune.run.step_lines import StepLines

    class Bar:
        def __init__(self):
            self.said = []

        def set_description_str(self, text, refresh=True):
            self.said.append(text)

    bar = Bar()
    with train._named_while_running(bar, "saving a checkpoint"):
        pass
    assert bar.said == []  # pytest's stderr is a file: left as it is
    monkeypatch.setattr(sys, "stderr", Terminal())
    with pytest.raises(KeyboardInterrupt), train._named_while_running(bar, "saving a checkpoint"):
        assert bar.said == ["saving a checkpoint"]
        raise KeyboardInterrupt
    assert bar.said == ["saving a checkpoint", ""]


def test_no_progress_lines_name_what_outlasts_their_rhythm_between_steps():
    """--no-progress: an evaluation or a save that outlasts StepLines.every_s is said while it runs, and
    again each every_s; one over sooner says nothing."""
    from slimtune import train
    from slimtune.run.step_lines import StepLines

    said = []
    with train._named_while_running(StepLines(3, 0, said.append, every_s=60.0), "evaluating after step 1"):
        pass
    assert said == []
    with train._named_while_running(StepLines(3, 0, said.append, every_s=0.02), "saving step 2"):
        waited = time.monotonic()
        while len(said) < 2 and time.monotonic() - waited < 30:  # the watcher's lines, however loaded the machine
            time.sleep(0.01)
    count = len(said)
    assert count >= 2 and all(line.startswith("saving step 2 (") and line.endswith(" s so far)") for line in said)
    time.sleep(0.1)
    assert len(said) == count  # nothing said once it has ended
