"""SHOAL_TRACE (shoal.runtime.common.trace): a diagnostic that never costs a member its life."""

from __future__ import annotations

import json
import logging
import os

from shoal.runtime import common


def test_trace_makes_its_folder_and_a_bad_one_is_given_up_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(common, "_TRACE", [])
    folder = tmp_path / "not" / "there"
    monkeypatch.setenv("SHOAL_TRACE", str(folder))
    common.trace("s0", "commit_start", step=3)
    lines = (folder / f"trace-{os.getpid()}.jsonl").read_text().splitlines()
    assert [(e["who"], e["ev"], e["step"]) for e in map(json.loads, lines)] == [("s0", "commit_start", 3)]
    # a folder that cannot be made (a file is in its way): one warning, no exception, no trace
    monkeypatch.setattr(common, "_TRACE", [])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SHOAL_TRACE", str(blocker / "sub"))
    with caplog.at_level(logging.WARNING):
        common.trace("w0", "pull")
        common.trace("w0", "pulled")
    assert sum("cannot write the trace" in r.getMessage() for r in caplog.records) == 1
    assert not (blocker / "sub").exists()
