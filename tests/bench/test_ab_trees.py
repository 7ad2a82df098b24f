"""bench/ab_trees.py: the Markdown cells it reads, and a real alternating run over two stand-in checkouts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.ab_trees import main, table_rows

TABLE = """
### Recovery
| scenario | spotrun | target |
|---|---|---|
| node_loss_sigkill | 0.32 s (0.30-0.32, n=1) | <= 3 s |
| scale_up | failed/>75 s (x1) | <= 3 s |

logs: somewhere
| other | x |
|---|---|
| words only | none |
"""


def test_rows_give_the_chosen_columns_first_number_and_a_failure_as_none() -> None:
    assert list(table_rows(TABLE, None)) == [("node_loss_sigkill", 0.32), ("scale_up", None), ("words only", None)]
    assert list(table_rows(TABLE, "target")) == [("node_loss_sigkill", 3.0), ("scale_up", 3.0)]
    assert list(table_rows(TABLE, "absent")) == []


def checkout(root: Path, seconds: str) -> Path:
    """A stand-in checkout whose script prints a one-row table and appends its side to a shared order file."""
    root.mkdir()
    (root / "job.py").write_text(
        "import sys\n"
        f"open(sys.argv[1], 'a').write('{root.name}\\n')\n"
        f"print('| scenario | time |')\nprint('|---|---|')\nprint('| recovery | {seconds} s |')\n")
    return root


def test_two_checkouts_alternate_and_the_ratio_is_after_over_before(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    before, after = checkout(tmp_path / "old", "2.00"), checkout(tmp_path / "new", "3.00")
    order = tmp_path / "order.txt"
    assert main(["--before", str(before), "--after", str(after), "--pairs", "2", "--python", sys.executable,
                 "--lock", str(tmp_path / "lock"), "--out", str(tmp_path / "out"), "--", "job.py", str(order)]) == 0
    assert order.read_text().split() == ["old", "new", "old", "new"]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| recovery |"))
    assert row == "| recovery | 2.00 (2.00-2.00, n=2) | 3.00 (3.00-3.00, n=2) | 1.50 | after slower |"
    assert (tmp_path / "out" / "1-after.stdout").read_text().endswith("| recovery | 3.00 s |\n")
