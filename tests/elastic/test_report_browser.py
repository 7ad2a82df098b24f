"""The ``spotrun report --html`` page in a real headless Chromium (Debian's ``chromium``; ``.ci/browser.sh``
installs it): its script runs (a marker it sets is in the DOM), the console stays free of errors (checked
against a page with a deliberate error, so the check itself is shown to catch one), nothing is fetched, and
a screenshot is taken."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from elastic import report
from elastic.report_html import render_page
from tests.elastic.test_report import EVENTS, JOURNAL, PROGRESS

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars"]
_CONSOLE_ERROR = re.compile(r"(Uncaught|:ERROR:CONSOLE|CONSOLE\(\d+\).*[Ee]rror)")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium is not installed: run .ci/browser.sh (apt-get install -y chromium) as root"
    return found


def run_chromium(args: list[str], profile: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Chromium with the test flags and a fresh profile; its whole process group is reaped afterwards."""
    proc = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its helper processes (zygote, renderer), if any outlived it
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if _CONSOLE_ERROR.search(line)]


def page(tmp_path: Path) -> Path:
    recs = report.recoveries(EVENTS, JOURNAL, PROGRESS)
    line = report.timeline(EVENTS, report.faults_from(JOURNAL), recs)
    out = tmp_path / "report.html"
    out.write_text(render_page(line, recs, report.totals(EVENTS, recs, PROGRESS)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_report_page_renders_in_headless_chromium_without_console_errors(tmp_path: Path) -> None:
    html = page(tmp_path)
    dom = run_chromium(["--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000", "--dump-dom",
                        html.as_uri()], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert 'data-rendered="ok"' in dom.stdout, "the page's script ran and found its charts"
    assert dom.stdout.count('class="seg"') >= 10, "the timeline's bars are in the rendered DOM"
    assert console_errors(dom.stderr) == [], dom.stderr[-3000:]

    # The check catches a console error: the same page with a script that throws.
    broken = tmp_path / "broken.html"
    broken.write_text(html.read_text().replace("</body>", "<script>undefinedFunction();</script></body>"))
    bad = run_chromium(["--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000", "--dump-dom",
                        broken.as_uri()], tmp_path / "profile-broken")
    assert console_errors(bad.stderr), f"a thrown error must show in the console log:\n{bad.stderr[-3000:]}"

    shot = tmp_path / "report.png"
    done = run_chromium([f"--screenshot={shot}", "--window-size=1280,1000", html.as_uri()], tmp_path / "profile-shot")
    assert done.returncode == 0 and shot.exists(), done.stderr[-3000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, "a real picture, not a blank page"
