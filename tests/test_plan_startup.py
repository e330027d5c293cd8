"""``shoal plan`` and ``shoal simulate`` stay free of torch from start to finish, not only at
import: the planner, cost model and simulator never pull it in, so the commands start fast
(issue #11's target: ``shoal plan --scenario gaming-world`` <= 1 s; measured by
``bench/bench_cli_start.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import sys
import shoal.plan, shoal.sim
assert "torch" not in sys.modules, "import shoal.plan, shoal.sim imported torch"
from shoal.cli import main
assert main(["plan", "--scenario", "demo"]) == 0
assert main(["simulate", "--scenario", "demo", "--steps", "1"]) == 0
print("torch" in sys.modules)
"""


@pytest.mark.timeout(120)
def test_plan_and_simulate_commands_never_import_torch():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "torch was imported while planning or simulating"
