"""Local mode on a real swarm: every merge weighs each contributor by the micro-batches it
covered in the round (not one share per worker), as the merge itself applied them."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.traces import accepted_gradients

RUN = dict(model="tiny", micro_batches=6, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)


def _gives_up_order_at(acked: list[int]) -> int | None:
    """The micro-batch at which a local-mode worker with no room beyond its plan stops summing
    its step in micro-batch order (LocalFold), given the order its results were accepted in."""
    from shoal.runtime.sync.ordered import LocalFold

    fold = LocalFold()
    for mb in acked:
        fold.add(mb, {})
        if fold.rest is not None:
            return mb
    return None


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_merge_weighs_contributors_by_their_micro_batches(tmp_path, monkeypatch):
    """One stage, two workers, one of them 0.25 s slower a task, H = 2: the shares the merge
    summed the pseudo-gradients with (logged from the merge's own computation) are each
    worker's micro-batches over the round's, as the workers themselves reported them; the
    round's micro-batches add up to H x M; and the workers' counts are uneven, so a merge
    that weighs workers equally gives other shares. The workers have no room for a gradient
    beyond their plan (--memory-gb 0.032: the stage needs 30.2 MB, a gradient 5.3): each sums a
    step in micro-batch order until a result comes that is not the next, then keeps one sum
    (LocalFold), as its log says, where the order its results were accepted in (traced) says."""
    from shoal.runtime.processes.launch import LaunchConfig, launch

    steps, h = 4, 2
    out = tmp_path / "run"
    monkeypatch.setenv("SHOAL_TRACE", str(tmp_path))
    launch(LaunchConfig(out=str(out), **RUN, steps=steps, stages=1, workers=2, dead_after_s=5.0, min_lease_s=1.5,
                        timeout_s=280, sync="local", sync_every=h, outer_lr=0.7, outer_momentum=0.5,
                        # (a fixed delay, not --fault slow's factor of the compute: a tiny task's
                        # compute is small beside its calls, and a loaded CI box once gave
                        # both workers 6 of 12 micro-batches in both rounds at factor 3)
                        worker_args=[["--memory-gb", "0.032"], ["--slow", "0.25", "--memory-gb", "0.032"]]))
    acked = accepted_gradients(tmp_path)
    logs = "".join((out / "logs" / f"worker{k}.log").read_text() for k in range(2))
    gave_up = {(w, int(step)): int(mb) for w, step, mb in
               re.findall(r"(w\d) sums step (\d+)'s gradients as they are accepted from micro-batch (\d+) on", logs)}
    want = {k: _gives_up_order_at(v) for k, v in acked.items()}
    assert acked and gave_up == {k: v for k, v in want.items() if v is not None}, (gave_up, acked)
    assert gave_up, acked  # two workers share the stage: one gets micro-batches after another's gap
    text = (out / "logs" / "server0.log").read_text()
    merges = [json.loads(m.group(1)) for m in re.finditer(r"local merge (\{.*\})$", text, re.M)]
    assert [m["version"] for m in merges] == [2, 4], merges
    uneven = False
    for m in merges:
        own = {}
        for mid in m["contributors"]:
            name = mid.rsplit("-", 1)[1]
            sent = re.findall(rf"sent its pseudo-gradient for v{m['version']} covering (\d+) micro-batches",
                              (out / "logs" / f"worker{name[1:]}.log").read_text())
            assert sent, (name, m)
            own[mid] = int(sent[-1])
        assert m["contributors"] == own
        total = sum(own.values())
        assert total == h * RUN["micro_batches"], m  # every micro-batch of the round, each once
        assert m["shares"] == {mid: pytest.approx(n / total, abs=1e-8) for mid, n in own.items()}
        uneven |= len(set(own.values())) > 1
    assert uneven, merges
