"""bench/elastic_bench.py's pure part: which survivors' worker pids a recovery kept and the steps it redid."""

from __future__ import annotations

from tests.harness.scripts import load_script

eb = load_script("bench/elastic_bench.py")


def _line(pid: int, rank: int, world: int, step: int, t: float) -> dict:
    return {"rank": rank, "world_size": world, "step": step, "pid": pid, "t_wall": t}


def test_an_in_place_survivor_keeps_its_pid_and_redoes_nothing() -> None:
    progress = [_line(1, 0, 2, s, float(s)) for s in range(1, 6)] + [_line(2, 1, 2, s, float(s)) for s in range(1, 6)]
    progress += [_line(1, 0, 1, 6, 6.3), _line(1, 0, 1, 7, 6.4)]
    assert eb.survivor_stats(progress, 5.5, 6.3, {2, 3}) == (1, 1, 0)


def test_a_restarted_survivor_is_not_kept_and_an_older_restore_counts_as_redone() -> None:
    progress = [_line(1, 0, 2, s, float(s)) for s in range(1, 6)] + [_line(2, 1, 2, s, float(s)) for s in range(1, 6)]
    progress += [_line(7, 0, 1, 3, 6.5), _line(7, 0, 1, 4, 8.0)]  # 8.0 is past the window: not read
    assert eb.survivor_stats(progress, 5.5, 6.5, frozenset({2})) == (0, 1, 3)
    assert eb.survivor_stats([], 5.5, 6.5, frozenset()) == (0, 0, 0)
    # an earlier job's lines in the same file (a later step, other pids) are not this job's old group
    earlier = [_line(5, 0, 2, 90, 0.5)]
    assert eb.survivor_stats(earlier + progress, 5.5, 6.5, frozenset({2}), since=0.9) == (0, 1, 3)
    assert eb.survivor_stats(earlier + progress, 5.5, 6.5, frozenset({2})) == (0, 1, 88)
    # a join: no victims, the one old worker kept beside the joiner
    grow = [_line(1, 0, 1, s, float(s)) for s in range(1, 4)] + [_line(1, 0, 2, 4, 4.0), _line(9, 1, 2, 4, 4.0)]
    assert eb.survivor_stats(grow, 3.5, 4.0, frozenset()) == (1, 1, 0)


def test_samples_report_kept_pids_over_the_recoveries(tmp_path) -> None:
    import json

    progress = tmp_path / "progress.jsonl"
    lines = [_line(1, 0, 2, s, float(s)) for s in range(1, 4)] + [_line(1, 0, 1, 4, 4.0)]
    progress.write_text("".join(json.dumps(x) + "\n" for x in lines))
    samples = eb.Samples(values=[1.0], recoveries=[(progress, 0.0, 3.5, 4.0, frozenset({2}))])
    assert samples.kept_cell() == "1/1 kept, 0 redone"
    assert eb.Samples().kept_cell() == "-"
