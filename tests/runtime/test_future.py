"""One-shot completions (runtime/future.py): `OpFuture` and `wait_all`."""

from __future__ import annotations

import threading

import pytest

from tierplan.runtime.future import OpFuture, wait_all


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
