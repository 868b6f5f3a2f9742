"""agent/sidecar_uplink.py against a fake service (httpx.MockTransport), clock injected: batches of at most 256
windows or every flush interval, acks in arrival order with the windows, refusals and rejections counted by
reason, a window whose answer was lost counted once when the retry finds it stored, the queue bounded with
drop-oldest, and received == sent + dropped + queued at every step."""

from __future__ import annotations

from tests.agent.sidecar.helpers import FakeClock, FakeService, TopRng, ack, plan, registration, telemetry
from tierplan.agent.sidecar_client import ServiceClient
from tierplan.agent.sidecar_metrics import SidecarMetrics
from tierplan.agent.sidecar_uplink import Uplink, UplinkConfig


def make(svc: FakeService, clock: FakeClock, **config: object) -> Uplink:
    up = Uplink(ServiceClient("http://svc", transport=svc.transport()), SidecarMetrics(),
                UplinkConfig(**config), clock=clock, rng=TopRng())  # type: ignore[arg-type]
    up.add_registration(registration())
    return up


def balanced(up: Uplink) -> bool:
    s = up.stats()
    return s["received"] == s["sent"] + sum(s["dropped"].values()) + s["queued"] + s["in_flight"]


def test_a_full_queue_goes_out_in_batches_of_at_most_256() -> None:
    svc, clock = FakeService(), FakeClock()
    up = make(svc, clock, flush_s=60.0)
    for seq in range(600):
        up.add_window(telemetry(seq))
    up.tick()
    assert svc.batches == [256, 256, 88]  # full batches went at once, so did the rest with them
    assert [w["window_seq"] for w in svc.windows] == list(range(600))
    assert up.stats()["sent"] == 600 and balanced(up)
    assert up.metrics.registry.get_sample_value("tierplan_sidecar_windows_sent_total") == 600
    assert up.metrics.registry.get_sample_value("tierplan_sidecar_post_seconds_count") == 3


def test_a_partial_batch_waits_for_the_flush_interval() -> None:
    svc, clock = FakeService(), FakeClock()
    up = make(svc, clock, flush_s=2.0)
    up.tick()  # registers; nothing queued
    for seq in range(10):
        up.add_window(telemetry(seq))
    clock.t += 1.0
    up.tick()
    assert svc.batches == [] and up.stats()["queued"] == 10 and balanced(up)
    clock.t += 1.0
    up.tick()
    assert svc.batches == [10] and up.stats()["queued"] == 0 and balanced(up)


def test_a_batch_stays_under_the_byte_limit() -> None:
    svc, clock = FakeService(), FakeClock()
    one = len(telemetry(0).model_dump_json())
    up = make(svc, clock, flush_s=0.0, max_batch_bytes=3 * one + 10)
    for seq in range(7):
        up.add_window(telemetry(seq))
    up.tick()
    assert svc.batches == [3, 3, 1]


def test_acks_go_in_arrival_order_with_the_windows() -> None:
    svc, clock = FakeService(), FakeClock()
    svc.plans.append(plan(1))
    up = make(svc, clock, flush_s=60.0)
    up.add_window(telemetry(0))
    up.add_window(telemetry(1))
    up.add_ack(ack(1))
    up.add_window(telemetry(2, applied=1))
    up.tick()
    posts = [r for r in svc.requests if r.startswith("POST /v1/telemetry") or r == "POST /v1/acks"]
    # The ack does not wait for the flush interval: it flushes the windows before it, goes, then the rest follow.
    assert posts == ["POST /v1/telemetry", "POST /v1/acks", "POST /v1/telemetry"]
    assert svc.batches == [2, 1] and svc.acks[0]["version"] == 1 and up.stats()["acks_sent"] == 1


def test_rejected_windows_are_dropped_by_code_and_counted() -> None:
    svc, clock = FakeService(reject={3: "model_mismatch", 4: "time_backwards"}), FakeClock()
    up = make(svc, clock, flush_s=0.0)
    for seq in range(6):
        up.add_window(telemetry(seq))
    up.tick()
    s = up.stats()
    assert s["sent"] == 4 and s["dropped"] == {"rejected_model_mismatch": 1, "rejected_time_backwards": 1}
    assert balanced(up)
    get = up.metrics.registry.get_sample_value
    assert get("tierplan_sidecar_windows_dropped_total", {"reason": "rejected_model_mismatch"}) == 1


def test_a_refused_batch_is_dropped_and_counted_not_retried_forever() -> None:
    svc, clock = FakeService(refuse_status=413), FakeClock()
    up = make(svc, clock, flush_s=0.0)
    for seq in range(5):
        up.add_window(telemetry(seq))
    up.tick()
    up.tick()
    assert svc.batches == [] and up.stats()["dropped"] == {"http_413": 5} and balanced(up)
    assert up.fail.mode == "online"  # the service answered: refusing is not being away
    assert up.metrics.registry.get_sample_value("tierplan_sidecar_service_errors_total", {"kind": "http_4xx"}) == 1


def test_a_lost_answer_is_retried_and_the_stored_windows_count_once() -> None:
    svc, clock = FakeService(read_timeout=True), FakeClock()
    up = make(svc, clock, flush_s=0.0)
    for seq in range(4):
        up.add_window(telemetry(seq))
    clock.t += up.tick()  # stored by the service, answer lost: the batch goes back, marked maybe delivered
    assert len(svc.windows) == 4 and up.stats()["queued"] == 4 and balanced(up)
    svc.read_timeout = False
    up.add_window(telemetry(4))
    clock.t += up.tick()
    s = up.stats()
    assert s["sent"] == 5 and s["redelivered"] == 4 and s["dropped"] == {} and balanced(up)
    assert [w["window_seq"] for w in svc.windows] == [0, 1, 2, 3, 4]


def test_a_repeat_that_was_never_retried_is_not_mistaken_for_a_redelivery() -> None:
    svc, clock = FakeService(reject={7: "seq_not_increasing"}), FakeClock()
    up = make(svc, clock, flush_s=0.0)
    up.add_window(telemetry(7))
    up.tick()
    assert up.stats()["dropped"] == {"rejected_seq_not_increasing": 1} and up.stats()["redelivered"] == 0


def test_the_queue_is_bounded_and_drops_the_oldest_while_the_service_is_away() -> None:
    svc, clock = FakeService(down=True), FakeClock()
    up = make(svc, clock, flush_s=0.0, max_queued_windows=100)
    for seq in range(250):
        up.add_window(telemetry(seq))
        if seq % 50 == 0:
            clock.t += up.tick()
        assert up.stats()["queued"] <= 100 and balanced(up)
    assert up.stats()["dropped"] == {"queue_full": 150}
    svc.down = False
    clock.t += 60.0
    up.tick()
    assert [w["window_seq"] for w in svc.windows] == list(range(150, 250))  # the newest hundred
    assert up.stats()["sent"] == 100 and balanced(up)
    assert up.metrics.registry.get_sample_value("tierplan_sidecar_queue_depth") == 0


def test_plan_polls_carry_since_version_and_the_etag() -> None:
    svc, clock = FakeService(), FakeClock()
    up = make(svc, clock, poll_s=1.0)
    up.tick()
    assert svc.polls == [("0", None)] and up.current_plan("agent-t", 0) is None  # 204: no plan yet
    svc.plans.append(plan(1))
    clock.t += 1.0
    up.tick()
    clock.t += 1.0
    up.tick()
    assert svc.polls[1:] == [("0", None), ("1", '"v1"')]  # the second poll was a cheap 304
    assert up.stats()["plans_pulled"] == 1 and up.current_plan("agent-t", 0) == plan(1)
    assert up.metrics.registry.get_sample_value("tierplan_sidecar_plan_version") == 1


def test_windows_for_an_agent_the_service_forgot_are_sent_again_after_registering() -> None:
    svc, clock = FakeService(), FakeClock()
    up = make(svc, clock, flush_s=0.0)
    up.tick()
    svc.forgot = True  # the service came back on a fresh database, without the sidecar noticing an outage
    for seq in range(4):
        up.add_window(telemetry(seq))
    up.tick()
    assert up.stats()["queued"] == 4 and svc.windows == [] and balanced(up)  # waiting for the registration
    up.tick()
    assert svc.registrations == 2 and [w["window_seq"] for w in svc.windows] == [0, 1, 2, 3]
    assert up.stats()["sent"] == 4 and up.stats()["dropped"] == {} and balanced(up)


def test_a_window_still_unknown_after_registering_again_is_dropped_and_counted() -> None:
    svc, clock = FakeService(reject={0: "unknown_agent"}), FakeClock()
    up = make(svc, clock, flush_s=0.0)
    up.add_window(telemetry(0))
    for _ in range(3):
        up.tick()
    assert svc.registrations == 2 and svc.batches == [1, 1]  # sent once more, not forever
    assert up.stats()["dropped"] == {"rejected_unknown_agent": 1} and balanced(up)
