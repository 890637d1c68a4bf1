"""Progress for long jobs: in a log file (stderr not a terminal) it still shows while running."""

import pytest

from ralm.errors import RalmError
from ralm.progress import library_bars_enabled, progress_bar, track


def test_a_log_file_gets_progress_lines_while_the_job_runs(capsys, monkeypatch):
    monkeypatch.setenv("RALM_NO_PROGRESS", "0")  # conftest silences progress for the other tests
    monkeypatch.setenv("RALM_PROGRESS_INTERVAL", "0")
    seen = []
    for i in track(range(3), 3, "embedding"):
        seen.append(capsys.readouterr().err)  # what the log holds before item i is processed
    assert "1/3" in seen[1] and "2/3" in seen[2]  # not only the final line at the end
    assert "3/3" in capsys.readouterr().err


def test_progress_is_silenced_by_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("RALM_PROGRESS_INTERVAL", "0")
    monkeypatch.setenv("RALM_NO_PROGRESS", "1")
    assert list(track(range(3), 3, "embedding")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_library_bars_stay_out_of_log_files(capsys, monkeypatch):
    import sys

    from ralm.retrieval.backends.bm25 import BM25Index

    monkeypatch.setenv("RALM_NO_PROGRESS", "0")
    BM25Index.build(["the cat sat", "a dog ran"])  # bm25s draws tqdm bars where allowed
    assert capsys.readouterr().err == ""  # stderr is captured here, as in a log file
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert library_bars_enabled() and not library_bars_enabled(False)


def test_lines_are_rate_limited(capsys, monkeypatch):
    monkeypatch.setenv("RALM_NO_PROGRESS", "0")
    monkeypatch.setenv("RALM_PROGRESS_INTERVAL", "3600")
    list(track(range(50), 50, "embedding"))
    assert capsys.readouterr().err.count("embedding") == 1  # only the final state


def test_a_bad_interval_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RALM_NO_PROGRESS", "0")
    monkeypatch.setenv("RALM_PROGRESS_INTERVAL", "1m")
    with pytest.raises(RalmError, match="RALM_PROGRESS_INTERVAL must be a number of seconds, got '1m'"):
        list(track(range(3), 3, "embedding"))


def test_a_log_shows_time_remaining_for_jobs_advancing_in_large_blocks(monkeypatch):
    monkeypatch.setenv("RALM_NO_PROGRESS", "0")
    now = [0.0]
    with progress_bar() as bar:
        bar.get_time = lambda: now[0]  # a block of 8,192 every 90 s
        task = bar.add_task("embedding chunks", total=8192 * 4)
        for _ in range(2):
            now[0] += 90.0
            bar.advance(task, 8192)
        assert bar.tasks[0].time_remaining == pytest.approx(180.0)
