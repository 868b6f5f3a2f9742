"""Retry schedule and fail-static modes, with an injected clock and random source (no real time passes):
full jitter stays within the doubling ceiling; the uplink waits exactly the backoff it drew, counts each
retry, goes last_good -> safe_static when the TTL runs out (each entry counted once), and comes back online
at the first answer."""

from __future__ import annotations

import random

import pytest

from tests.agent.sidecar.helpers import AGENT, FakeClock, FakeService, TopRng, plan, registration, telemetry
from tierplan.agent.sidecar_backoff import Backoff
from tierplan.agent.sidecar_client import ServiceClient
from tierplan.agent.sidecar_failstatic import FailStatic, Mode
from tierplan.agent.sidecar_metrics import SidecarMetrics
from tierplan.agent.sidecar_uplink import Uplink, UplinkConfig


def test_full_jitter_stays_under_a_doubling_ceiling_up_to_the_cap() -> None:
    b = Backoff(base_s=0.5, cap_s=4.0, rng=random.Random(7))
    delays = [b.next_delay_s() for _ in range(8)]
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len(set(delays)) == len(delays)  # jittered: no two waits alike
    assert [Backoff(0.5, 4.0, rng=TopRng()).ceiling_s(n) for n in range(1, 9)] == ceilings  # type: ignore[arg-type]
    b.reset()
    assert b.failures == 0 and b.next_delay_s() <= 0.5


def test_a_seeded_schedule_repeats_exactly() -> None:
    a, b = Backoff(0.2, 10.0, random.Random(3)), Backoff(0.2, 10.0, random.Random(3))
    assert [a.next_delay_s() for _ in range(6)] == [b.next_delay_s() for _ in range(6)]


def test_bad_backoff_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="0 < base_s <= cap_s"):
        Backoff(base_s=2.0, cap_s=1.0)


def test_fail_static_modes_in_order() -> None:
    changes: list[tuple[Mode, Mode]] = []
    fs = FailStatic(ttl_s=30.0, now_s=100.0, on_change=lambda a, b: changes.append((a, b)))
    fs.answered(110.0)
    fs.unreachable(111.0)
    assert fs.mode is Mode.LAST_GOOD and fs.serves_cached_plan
    fs.age(139.9)
    assert fs.mode is Mode.LAST_GOOD
    fs.unreachable(140.0)  # 30 s since the last answer at 110
    assert fs.mode is Mode.SAFE_STATIC and not fs.serves_cached_plan
    fs.unreachable(500.0)
    fs.answered(501.0)
    assert fs.mode is Mode.ONLINE
    assert changes == [(Mode.ONLINE, Mode.LAST_GOOD), (Mode.LAST_GOOD, Mode.SAFE_STATIC),
                       (Mode.SAFE_STATIC, Mode.ONLINE)]
    assert fs.entries == {Mode.LAST_GOOD: 1, Mode.SAFE_STATIC: 1, Mode.ONLINE: 1}


def make_uplink(svc: FakeService, clock: FakeClock, ttl_s: float = 30.0, **config: object) -> tuple[Uplink, list]:
    pushed: list = []
    up = Uplink(ServiceClient("http://svc", transport=svc.transport()), SidecarMetrics(),
                UplinkConfig(plan_ttl_s=ttl_s, backoff_base_s=0.5, backoff_cap_s=4.0, **config),  # type: ignore[arg-type]
                clock=clock, rng=TopRng(), push=lambda a, p: pushed.append((a, p.version)))  # type: ignore[arg-type]
    return up, pushed


def sample(up: Uplink, name: str, **labels: str) -> float:
    return up.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_uplink_retries_on_the_backoff_schedule_and_goes_fail_static_then_recovers() -> None:
    svc, clock = FakeService(), FakeClock()
    up, pushed = make_uplink(svc, clock, ttl_s=10.0)
    up.add_registration(registration())
    svc.plans.append(plan(1))
    up.tick()
    assert pushed == [(AGENT, 1)] and up.current_plan(AGENT, 0) == plan(1) and up.fail.mode is Mode.ONLINE

    svc.down = True
    clock.t += 1.0  # t=1001: the next poll is due, and fails
    waits = []
    for _ in range(5):
        waits.append(up.tick())
        clock.t += waits[-1]
    # Each wait is the backoff's full ceiling (TopRng), doubling to the cap; the fifth (4 s) would overrun the
    # TTL (10 s after the last answer at t=1000), so the uplink wakes at t=1010 to switch on time.
    assert waits == [0.5, 1.0, 2.0, 4.0, 1.5] and clock.t == 1010.0
    assert up.fail.mode is Mode.LAST_GOOD and up.current_plan(AGENT, 0) == plan(1)  # the last good plan
    assert up.tick() == 2.5  # the retry drawn before is still due at 1012.5
    assert up.fail.mode is Mode.SAFE_STATIC
    assert up.current_plan(AGENT, 0) is None  # withdrawn: every agent keeps what it applied
    assert sample(up, "tierplan_sidecar_retries_total") == 5
    assert sample(up, "tierplan_sidecar_service_errors_total", kind="connect") == 5
    assert sample(up, "tierplan_sidecar_fail_static") == 1
    assert sample(up, "tierplan_sidecar_fail_static_total", mode="last_good") == 1
    assert sample(up, "tierplan_sidecar_fail_static_total", mode="safe_static") == 1

    for seq in range(5):
        up.add_window(telemetry(seq))  # made while the service is away: queued, not lost
    svc.down, registered_before = False, svc.registrations
    svc.plans.append(plan(2))
    clock.t += 2.5
    up.tick()  # one tick catches up: re-register, flush the queue, poll
    assert up.fail.mode is Mode.ONLINE and sample(up, "tierplan_sidecar_fail_static") == 0
    assert svc.registrations == registered_before + 1  # told again who it is
    assert [w["window_seq"] for w in svc.windows] == list(range(5))
    assert pushed[-1] == (AGENT, 2) and up.current_plan(AGENT, 1) == plan(2)  # polling resumed
    assert sample(up, "tierplan_sidecar_fail_static_total", mode="safe_static") == 1  # entries, not ticks


def test_the_retry_count_is_one_per_unanswered_tick() -> None:
    svc, clock = FakeService(down=True), FakeClock()
    up, _ = make_uplink(svc, clock, ttl_s=1000.0)
    up.add_registration(registration())
    waits = []
    for _ in range(6):
        waits.append(up.tick())
        clock.t += waits[-1]
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert sample(up, "tierplan_sidecar_retries_total") == 6 and svc.registrations == 0
