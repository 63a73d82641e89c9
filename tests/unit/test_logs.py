"""raylane.logs.scope: a call of the Python API shows the command's lines and sends the rest to
its library log, then leaves the caller's logging as it found it (issue 47, finding 10; the
whole call, on Ray: tests/e2e/test_api_voice.py)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

from raylane import logs


def test_a_call_prints_raylanes_lines_logs_the_rest_and_restores_the_callers_logging(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYLANE_HOME", str(tmp_path))
    monkeypatch.delenv(logs.VERBOSE_ENV, raising=False)
    monkeypatch.setattr(logs, "_process_wide", False)  # as in a script, not under the command
    root = logging.getLogger()
    mine = logging.StreamHandler(sys.stdout)  # a script's basicConfig
    root.addHandler(mine)
    before = (list(root.handlers), root.level, list(sys.meta_path), logging.getLogger("raylane").level)
    showwarning = warnings.showwarning
    try:
        with logs.scope(None, "train"):
            assert os.environ[logs.VERBOSE_ENV] == "0"
            logging.getLogger("raylane").info("raylane's own line")
            logging.getLogger("somelib").info("a library's chatter")
            logging.getLogger("somelib").error("a library's error")
            with warnings.catch_warnings():  # shown whatever filters earlier tests in this process left
                warnings.simplefilter("always", UserWarning)
                warnings.warn("a library's warning", UserWarning, stacklevel=1)
            with logs.scope(True, "train"):  # a call inside a call: the outer one's set-up holds
                assert os.environ[logs.VERBOSE_ENV] == "0"
        out, err = capsys.readouterr()
        assert out == ""  # the script's handler heard nothing during the call
        assert err.splitlines() == ["raylane's own line", "somelib: a library's error"]
        text = logs.log_file().read_text()
        assert "a library's chatter" in text and "a library's warning" in text and "raylane's own line" in text

        assert (list(root.handlers), root.level, list(sys.meta_path), logging.getLogger("raylane").level) == before
        assert logs.VERBOSE_ENV not in os.environ
        assert warnings.showwarning is showwarning  # Python's warnings are no longer captured
        logging.getLogger("somelib").warning("after the call")
        assert capsys.readouterr().out == "after the call\n"  # through the script's handler again

        with logs.scope(True, "train"):  # verbose=True: the libraries' warnings too, as --verbose
            logging.getLogger("somelib").warning("a library's warning, shown")
        assert capsys.readouterr() == ("", "a library's warning, shown\n")
        assert list(root.handlers) == before[0] and logs.VERBOSE_ENV not in os.environ
    finally:
        root.removeHandler(mine)


def test_an_api_calls_scope_sends_rays_own_output_to_the_log_and_puts_it_back(tmp_path, monkeypatch, capsys):
    """Ray's hooks live in raylane.onray.output (the ground floor knows no Ray): an API call's
    scope installs them as the command does after logs.setup, and undoes them with the call."""
    from raylane.onray import output
    from raylane.onray.internals import ray_worker as worker  # imports Ray (about a second)

    monkeypatch.setenv("RAYLANE_HOME", str(tmp_path))
    monkeypatch.delenv(logs.VERBOSE_ENV, raising=False)
    monkeypatch.setattr(logs, "_process_wide", False)
    ray_logger = logging.getLogger("ray")
    own = logging.StreamHandler(sys.stderr)  # what Ray's import gives its logger
    ray_logger.addHandler(own)
    printer, propagate = worker.print_to_stdstream, ray_logger.propagate
    try:
        with output.scope(None, "train"):
            assert own not in ray_logger.handlers and ray_logger.propagate
            worker.print_to_stdstream({"pid": 7, "lines": ["a raylet's notice"]})
            logging.getLogger("ray").warning("a Ray warning")
        assert capsys.readouterr().err == ""  # neither printed: both in the library log
        text = logs.log_file().read_text()
        assert "(7) a raylet's notice" in text and "a Ray warning" in text
        assert worker.print_to_stdstream is printer
        assert own in ray_logger.handlers and ray_logger.propagate == propagate

        with output.scope(True, "train"):  # verbose: Ray prints as it does
            assert own in ray_logger.handlers and worker.print_to_stdstream is printer
    finally:
        ray_logger.removeHandler(own)
