"""The live display state folds swarm records correctly."""

import io

from rich.console import Console

from shoal.demo.live import LiveState


def test_live_state_counts():
    st = LiveState(total_steps=10)
    recs = [
        {"event": "join", "device": "s0", "role": "server"},
        {"event": "join", "device": "w0", "role": "worker"},
        {"event": "join", "device": "w1", "role": "worker"},
        {"event": "join", "device": "w2", "role": "worker"},
        {"event": "assign", "device": "s0", "role": "server", "stage": 1},
        {"event": "replan", "why": "start", "assignment": {"w0": 0, "w1": 1, "w2": 1}},
        {"event": "step", "step": 0, "loss": 7.5, "tokens_per_s": 100.0, "requeues": 0},
        {"event": "kill", "device": "w1"},
        {"event": "leave", "device": "w1", "role": "worker", "why": "dead"},  # same loss, counted once
        {"event": "kill", "device": "s1"},  # a server: not a worker loss
        {"event": "step", "step": 1, "loss": 7.0, "tokens_per_s": 80.0, "requeues": 2, "val_loss": 7.1},
        {"event": "leave", "device": "w2", "role": "worker", "why": "timeout"},
        {"event": "join", "device": "w3", "role": "worker"},
        {"event": "replan", "why": "join", "assignment": {"w0": 0, "w3": 1}},
    ]
    for r in recs:
        st.update(r)
    assert st.step == 1 and st.loss == 7.0 and st.val_loss == 7.1 and st.tokens_per_s == 80.0
    assert st.requeued == 2
    assert st.workers_lost == 2 and st.workers_joined == 1
    assert st.live == {"w0", "w3"} and st.workers_per_stage() == [1, 1]
    buf = io.StringIO()
    Console(file=buf, width=120).print(st.table())
    out = buf.getvalue()
    assert "2/10" in out and "s0:1 s1:1" in out and "2 / 1" in out and "w3 joined" in out
