"""shoal's processes keep large buffers in the heap: a repeated few-MB allocation is not faulted in afresh."""

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource
import numpy as np
from shoal.memory import tune_malloc
ok = tune_malloc()
from shoal.net import shoal_pb2 as pb
frame = pb.Tensor(name="x", dtype="float32", shape=[1 << 20], data=b"\1" * (4 << 20))
for _ in range(3):  # warm: the first buffers come from the system either way
    np.frombuffer(frame.data, dtype=np.uint8).copy()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    # what decoding a 4 MB frame does (shoal.net.wire.decode_tensor): the payload's bytes, then
    # the array, each 1024 pages, made and freed
    np.frombuffer(frame.data, dtype=np.uint8).copy()
print(json.dumps({"ok": ok, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _probe(env_value: str | None) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "SHOAL_MALLOC"}
    if env_value is not None:
        env["SHOAL_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_tuned_process_reuses_large_buffers_and_the_system_setting_is_left_alone():
    tuned, system = _probe(None), _probe("system")
    assert tuned["ok"] is True and system["ok"] is False
    # 20 x 2 buffers of 1024 pages: with glibc's defaults the freed pair is trimmed off the heap
    # and faulted in again each time; tuned, they reuse it
    assert system["faults"] >= 10 * 1024
    assert tuned["faults"] < 1024


def test_the_entry_points_apply_it():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "shoal"
    for entry in ("cli.py", "runtime/processes/cli.py", "runtime/processes/forkserver.py"):
        assert "tune_malloc()" in (root / entry).read_text(), entry
