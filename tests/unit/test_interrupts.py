"""interrupts.watching: a Ctrl-C that something drops is raised again at the block's end (the imports'
case: an extension's initialisation may clear it), an error it left behind becomes the interrupt,
and a handler of the caller's own is left alone."""

import signal
import sys
import threading
import weakref

import pytest

from slimtune.run import interrupts


def ctrl_c_dropped() -> None:
    """SIGINT handled inside a finalizer: what the handler raises is printed and dropped."""
    class Thing:
        pass

    thing = Thing()
    weakref.finalize(thing, lambda: signal.getsignal(signal.SIGINT)(signal.SIGINT, None))
    del thing


@pytest.fixture(autouse=True)
def quiet_drops(monkeypatch):
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    return dropped


def test_a_dropped_ctrl_c_is_raised_at_the_blocks_end_and_python_s_handler_comes_back(quiet_drops):
    went_on = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts.watching():
            ctrl_c_dropped()
            went_on = True  # as the import of a module whose init cleared the interrupt goes on
    assert went_on and quiet_drops == [interrupts.Signalled]  # a KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupts.check()  # the request ended with its block


def test_an_error_left_by_a_dropped_ctrl_c_becomes_the_interrupt():
    with pytest.raises(KeyboardInterrupt):
        with interrupts.watching():
            ctrl_c_dropped()
            raise ImportError("cannot load module more than once per process")  # a module left half made
    with pytest.raises(ImportError):  # without a Ctrl-C an error is itself
        with interrupts.watching():
            raise ImportError("a real one")


def test_check_raises_only_on_the_main_thread_and_only_after_a_ctrl_c():
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.watching():
            interrupts.check()
            ctrl_c_dropped()
            worker = threading.Thread(target=lambda: seen.append(interrupts.check()))  # a pipeline worker goes on
            worker.start()
            worker.join()
            interrupts.check()
            seen.append("not reached")
    assert seen == [None]


def test_a_handler_of_the_callers_own_is_left_alone(monkeypatch):
    def own(signum, frame):
        pass

    monkeypatch.setattr(signal, "getsignal", lambda signum: own)  # as if the caller had installed it
    installed = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.append(handler))
    with interrupts.watching():
        pass
    assert installed == []


def test_sigterm_is_taken_as_ctrl_c_is_except_in_a_torchrun_rank(monkeypatch):
    """SIGTERM raises a Signalled carrying its number (exit 143); a rank under torchrun leaves it to
    its default (torchrun sends it to the surviving ranks, and the launcher says how the job ended)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        monkeypatch.delenv("RANK", raising=False)
        with pytest.raises(interrupts.Signalled) as info:
            with interrupts.watching():
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert (interrupts.exit_code(info.value), interrupts.stopped_by(info.value)) == (143, "stopped by SIGTERM")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        with interrupts.watching():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # Ctrl-C still is
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (interrupts.exit_code(KeyboardInterrupt()), interrupts.stopped_by(KeyboardInterrupt())) == (130, "interrupted")
