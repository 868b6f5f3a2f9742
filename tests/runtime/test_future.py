"""One-shot completions (runtime/future.py): `OpFuture`, `wait_all` and `wait_every`."""

from __future__ import annotations

import threading

import pytest

from tierplan.runtime.future import OpFuture, wait_all, wait_every


def test_an_op_future_completes_once_and_reraises_its_error() -> None:
    f = OpFuture("load of expert (0, 1)")
    assert not f.done() and not f.ok
    with pytest.raises(TimeoutError, match=r"load of expert \(0, 1\): not done within 0.01 s"):
        f.wait(0.01)
    f.set_result(ValueError("bad bytes"))
    assert f.done() and not f.ok
    with pytest.raises(ValueError, match="bad bytes"):
        f.wait()
    with pytest.raises(RuntimeError, match="completed twice"):
        f.set_result()


def test_wait_all_waits_for_every_future_and_raises_the_first_error_in_list_order() -> None:
    futs = [OpFuture(f"f{i}") for i in range(4)]
    done = threading.Event()

    def finish() -> None:  # out of order, the last one first
        for i in (3, 0, 2, 1):
            futs[i].set_result(KeyError(f"e{i}") if i in (1, 2) else None)
        done.set()

    t = threading.Thread(target=finish)
    t.start()
    with pytest.raises(KeyError, match="e1"):
        wait_all(futs, timeout_s=10)
    assert done.is_set() and all(f.done() for f in futs)
    t.join()
    wait_all([])
    slow = [OpFuture("a"), OpFuture("b")]
    slow[1].set_result()
    with pytest.raises(TimeoutError, match=r"a: not done within 0\.01 s"):
        wait_all(slow, timeout_s=0.01)


class _Interrupted(OpFuture):
    """A future whose first wait is interrupted (as a Ctrl-C lands in a lock wait) before it is done."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.waits = 0

    def wait(self, timeout_s: float | None = None) -> None:
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt
        super().wait(timeout_s)


def test_wait_every_waits_through_errors_and_interrupts_then_raises_the_first() -> None:
    """Every future is waited until done (what it moves is still in flight), past an error and an interrupt;
    then the interrupt is raised, or without one the first error in list order."""
    futs = [OpFuture("f0"), OpFuture("f1"), _Interrupted("f2"), OpFuture("f3")]
    errors = [None, ValueError("f1 failed"), None, OSError("f3 failed")]

    def finish() -> None:  # the interrupted one last: it is still running when its wait is interrupted
        for i in (0, 1, 3, 2):
            threading.Event().wait(0.02)
            futs[i].set_result(errors[i])

    threading.Thread(target=finish).start()
    with pytest.raises(KeyboardInterrupt):
        wait_every(futs)
    assert all(f.done() for f in futs) and futs[2].waits >= 2
    with pytest.raises(ValueError, match="f1 failed"):
        wait_every(futs)
    wait_every([])
