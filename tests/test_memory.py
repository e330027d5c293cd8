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


RELEASE_PROBE = r"""
import json, threading
from shoal.memory import release_free, tune_malloc
tune_malloc()

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

def stage_copies(out):
    # what a reference gradient's threads do: copies of a stage in blocks below the mmap threshold
    # (each a parameter's tensor), freed once summed, among small things made meanwhile that stay
    # (so no free block reaches the heap's top, the only part that goes back by itself)
    big = []
    for _ in range(64):
        big.append(bytearray(8 << 20))
        out.append(bytearray(4096))
    del big

kept = []
t = threading.Thread(target=stage_copies, args=(kept,))
t.start(); t.join()
stage_copies(kept)  # and the same on the main thread's heap
held = rss_mb()
ran = release_free()
print(json.dumps({"ran": ran, "held": held, "after": rss_mb()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_free_memory_the_arenas_keep_goes_back_to_the_system():
    """A stage server's phases (the screen's reference gradient on threads, a merge) make and
    drop copies of its stage in blocks the tuned heap keeps; freed but resident, they were still
    counted in its peak at the next phase. ``release_free`` gives them back."""
    out = json.loads(subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["ran"] is True
    assert out["held"] - out["after"] >= 500, out  # of the 2 x 512 MB made and freed
