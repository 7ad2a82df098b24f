"""``OutageClock`` (pure): a continuous run of rendezvous failures is transient within its bound, warned about
at its start and then every ``remind_every`` seconds, fatal past the bound; one success resets it."""

from __future__ import annotations

import pytest

from elastic.outage import OutageClock, OutageVerdict


def _verdicts(clock: OutageClock, observations: list[tuple[bool, float]]) -> list[OutageVerdict]:
    return [clock.observe(ok, now).verdict for ok, now in observations]


def test_no_failure_is_quiet() -> None:
    clock = OutageClock(bound=3.0)
    seen = clock.observe(True, 10.0)
    assert (seen.verdict, seen.failing_for, seen.fatal_in) == (OutageVerdict.OK, 0.0, 3.0)


def test_warns_at_the_start_then_every_remind_interval_then_fatal_past_the_bound() -> None:
    clock = OutageClock(bound=12.0, remind_every=5.0)
    ticks = [(False, 100.0 + 0.1 * i) for i in range(121)]  # one monitor tick every 0.1 s for 12 s
    verdicts = _verdicts(clock, ticks)
    warned_at = [now for (_, now), v in zip(ticks, verdicts, strict=True) if v is OutageVerdict.WARN]
    assert warned_at == pytest.approx([100.0, 105.0, 110.0])
    assert OutageVerdict.FATAL not in verdicts  # exactly at the bound: still transient
    seen = clock.observe(False, 112.01)
    assert seen.verdict is OutageVerdict.FATAL and seen.failing_for == pytest.approx(12.01) and seen.fatal_in == 0.0


def test_fatal_in_counts_down_from_the_first_failure() -> None:
    clock = OutageClock(bound=30.0)
    assert clock.observe(False, 50.0).fatal_in == 30.0
    assert clock.observe(False, 57.5).fatal_in == pytest.approx(22.5)


def test_a_success_resets_the_clock_and_reports_how_long_it_lasted() -> None:
    clock = OutageClock(bound=3.0, remind_every=5.0)
    assert _verdicts(clock, [(False, 0.0), (False, 2.9)]) == [OutageVerdict.WARN, OutageVerdict.QUIET]
    recovered = clock.observe(True, 2.95)
    assert recovered.verdict is OutageVerdict.RECOVERED and recovered.failing_for == pytest.approx(2.95)
    # A new outage starts its own count (and its own first warning): 2.9 + 2.9 s in total is not fatal.
    assert _verdicts(clock, [(False, 3.0), (False, 5.9), (True, 6.0), (True, 7.0)]) == [
        OutageVerdict.WARN, OutageVerdict.QUIET, OutageVerdict.RECOVERED, OutageVerdict.OK]


@pytest.mark.parametrize("field", ["bound", "remind_every"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_bad_settings_are_rejected_with_the_field_name(field: str, value: float) -> None:
    kwargs = {"bound": 3.0, field: value}
    with pytest.raises(ValueError, match=f"OutageClock.{field} must be a finite number of seconds > 0"):
        OutageClock(**kwargs)
