"""The live dashboard: its pure figures, its HTTP server (token, read-only), and the page and
JSON API during a real ``shoal launch`` -- in a real headless Chromium, with a kill -9'd
worker turning "gone"."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.runtime.ui.dashboard import (
    Dashboard,
    EventTail,
    authorized,
    finite,
    is_loopback,
    page,
    parse_bind,
)
from shoal.runtime.ui.stats import (
    StepTiming,
    achieved_step_time,
    bottleneck,
    eta_seconds,
    member_state,
    stage_waits_for,
)

# --------------------------------------------------------------------------- pure figures


def test_step_split_adds_up_and_averages_over_workers():
    t = StepTiming(step=3, opened=100.0)
    t.task("a", compute_s=2.0, leased_s=3.0)  # 1 s of transfer
    t.task("a", compute_s=1.0, leased_s=1.0)
    t.task("b", compute_s=1.0, leased_s=2.0)
    t.all_computed, t.all_counted, t.decided = 104.0, 104.5, 106.0
    sp = t.split(106.25)
    assert sp["step"] == 3 and sp["total_s"] == pytest.approx(6.25)
    assert sp["compute_s"] == pytest.approx((3.0 + 1.0) / 2)
    assert sp["transfer_s"] == pytest.approx((1.0 + 1.0) / 2)
    # pushes (104 -> 104.5) + applying the step after the answer (106 -> 106.25); the
    # wait for the other stages' reports (104.5 -> 106) is waiting, not sync
    assert sp["sync_s"] == pytest.approx(0.75)
    assert sp["waiting_s"] == pytest.approx(6.25 - 2.0 - 1.0 - 0.75)
    parts = sp["compute_s"] + sp["transfer_s"] + sp["sync_s"] + sp["waiting_s"]
    assert parts == pytest.approx(sp["total_s"])


def test_step_split_never_exceeds_the_total():
    t = StepTiming(step=0, opened=10.0)
    t.task("a", compute_s=50.0, leased_s=60.0)  # a task that straddled the step
    sp = t.split(12.0)
    assert sp["compute_s"] == pytest.approx(2.0)
    assert sp["transfer_s"] == sp["sync_s"] == sp["waiting_s"] == 0.0
    assert StepTiming(opened=5.0).split(6.0)["waiting_s"] == pytest.approx(1.0)  # no task: all waiting


def test_bottleneck_is_the_busiest_stage():
    a = {"compute_s": 1.0, "transfer_s": 0.1}
    b = {"compute_s": 0.5, "transfer_s": 0.9}
    assert bottleneck([a, b]) == 1
    assert bottleneck([a, None]) == 0
    assert bottleneck([None, None]) is None and bottleneck([]) is None


def test_achieved_step_time_and_member_state():
    assert achieved_step_time([]) is None
    assert achieved_step_time([9.0]) == 9.0
    assert achieved_step_time([9.0, 1.0, 3.0]) == 2.0  # step 0 (start-up) left out
    assert member_state(False, 0.0, 3.0) == "gone"
    assert member_state(True, 0.1, 3.0) == "active"
    assert member_state(True, 2.0, 3.0) == "silent"


def test_bind_loopback_and_token_checks():
    assert parse_bind("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_bind("[::1]:8080") == ("::1", 8080)
    for bad in ("8080", "host:", ":80", "h:99999", "h:x"):
        with pytest.raises(ShoalError, match="HOST:PORT"):
            parse_bind(bad)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.org")
    assert authorized("s3cret", "token=s3cret", "")
    assert authorized("s3cret", "", "Bearer s3cret")
    assert not authorized("s3cret", "token=s3cre", "")
    assert not authorized("s3cret", "", "Bearer nope")
    assert not authorized("", "token=", "")  # no run token: nothing is authorized


def test_bad_dashboard_flag_is_a_one_line_error(tmp_path, capsys):
    from shoal.cli import main

    for argv in (["launch", "--out", str(tmp_path / "run"), "--dashboard", "nope"],
                 ["demo", "--out", str(tmp_path / "demo"), "--dashboard", "host:99999"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --dashboard") and "HOST:PORT" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists() and not (tmp_path / "demo").exists()  # nothing started


def test_event_tail_reads_complete_lines_only(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []  # not there yet
    path.write_bytes(b'{"event": "join", "time_s": 1}\n{"event": "le')
    assert [e["event"] for e in tail.read()] == ["join"]
    with open(path, "ab") as f:
        f.write(b'ave", "time_s": 2}\n')
    assert [e["event"] for e in tail.read()] == ["join", "leave"]


def test_finite_replaces_nan_for_json():
    assert finite({"a": [1.0, float("nan")], "b": float("inf"), "c": "x"}) == {"a": [1.0, None], "b": None, "c": "x"}


def test_page_is_offline_and_self_contained():
    html = page().decode()
    assert "/*APP*/" not in html and "/*STYLE*/" not in html
    assert "function poll" in html and "api/state" in html
    # nothing fetched from elsewhere: no script/link/img sources, no absolute URLs
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html


# --------------------------------------------------------------------------- the server, no processes


def _spec(**kw) -> pb.RunSpec:
    base = dict(version=1, model="tiny", stages=2, steps=5, micro_batches=2, micro_batch_size=1, seq_len=8,
                dead_after_s=3.0, lr=1e-3, min_lr=1e-4, warmup=1, data="synthetic")
    base.update(kw)
    return pb.RunSpec(**base)


async def _get(port: int, target: str, method: str = "GET", headers: str = "") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.timeout(60)
def test_server_needs_the_token_and_is_read_only():
    from shoal.runtime.roles.coordinator import Coordinator
    from shoal.runtime.ui.status_table import status_tables

    async def main():
        coord = Coordinator(_spec(), "tok-123")
        await coord.Join(pb.JoinRequest(role="server", address="127.0.0.1:1", name="s0"), None)
        rep = await coord.Join(pb.JoinRequest(role="worker", name="w<0>", flops=2e9), None)
        await coord.Heartbeat(pb.MemberRequest(member_id=rep.member_id, stats=pb.MemberStats(
            stage=0, tasks_done=7, compute_s=3.5)), None)
        web = Dashboard(coord, "127.0.0.1:0", "tok-123", require_token=True)
        await web.start()
        port = int(web.url.rsplit(":", 1)[1].strip("/"))
        try:
            assert (await _get(port, "/api/state"))[0] == 401
            assert (await _get(port, "/"))[0] == 401
            assert (await _get(port, "/api/state?token=wrong"))[0] == 401
            code, body = await _get(port, "/api/state?token=tok-123")
            assert code == 200
            snap = json.loads(body)
            code, body2 = await _get(port, "/api/state", headers="Authorization: Bearer tok-123\r\n")
            assert code == 200 and json.loads(body2)["run"]["model"] == "tiny"
            code, html = await _get(port, "/?token=tok-123")
            assert code == 200 and b"shoal swarm" in html
            assert (await _get(port, "/api/state?token=tok-123", method="POST"))[0] == 405
            assert (await _get(port, "/nothing?token=tok-123"))[0] == 404
            # a garbage request line is answered, and the server keeps serving
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"garbage\r\n\r\n")
            assert b" 400 " in await asyncio.wait_for(r.read(), 10)
            w.close()
            assert (await _get(port, "/api/state?token=tok-123"))[0] == 200
        finally:
            await web.stop()
        # loopback without a forced token is open; a non-loopback bind demands one
        assert not Dashboard(coord, "127.0.0.1:0", "").require_token
        assert Dashboard(coord, "0.0.0.0:0", "t").require_token
        with pytest.raises(ShoalError, match="token"):
            Dashboard(coord, "0.0.0.0:0", "")
        return snap

    snap = asyncio.run(main())
    (w,) = snap["workers"]
    assert w["name"] == "w<0>" and w["state"] == "active" and w["tasks_done"] == 7
    assert w["mean_task_s"] == pytest.approx(0.5) and w["flops"] == 2e9
    assert [s["name"] for s in snap["servers"]] == ["s0"]
    assert [e["event"] for e in snap["events"]] == ["join", "assign", "join"]
    assert [s["layers"] for s in snap["stages"]] == [[0, 3], [3, 6]]

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(status_tables({"dashboard": snap}))
    text = console.export_text()
    assert "w<0>" in text and "active" in text and "stages" in text and "waiting for members" in text


@pytest.mark.timeout(60)
def test_snapshot_of_an_emulated_run_shows_links_rejoins_and_the_plan(tmp_path):
    """Links from the emulated scenario, a worker that left shown gone then live again,
    the planner's predicted step time, the event log read from events.jsonl."""
    from shoal.emulate.pacing import emulated_scenario
    from shoal.plan.types import Device, Link, Network, Scenario, Workload
    from shoal.runtime.roles.coordinator import Coordinator
    from shoal.runtime.ui.dashboard import snapshot

    wl = Workload(model="tiny", seq_len=8, global_batch=2, micro_batch_size=1, dtype_bytes=4)
    devs = [Device("h", "server", 0.0, 0.0, "eu", 1e9, 1e9, can_host_server=True),
            Device("a", "gpu", 1e12, 24e9, "eu", 1e8, 2e8), Device("b", "gpu", 5e11, 24e9, "us", 1e7, 1e7)]
    net = Network(intra={"eu": Link(0.001, 1e8), "us": Link(0.001, 1e8)}, inter={("eu", "us"): Link(0.05, 1e6)})
    em = emulated_scenario(Scenario(name="two", devices=devs, network=net, workload=wl), speedup=1e-3)

    async def main():
        c = Coordinator(_spec(), "tok", min_workers=2, out=str(tmp_path), emulated=em)
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}", device="h"), None)
        ws = [(await c.Join(pb.JoinRequest(role="worker", flops=1.0, name=f"w{i}", device=d), None)).member_id
              for i, d in enumerate("ab")]
        assert c.ready
        before = snapshot(c)
        await c.Leave(pb.MemberRequest(member_id=ws[1]), None)
        gone = snapshot(c)
        await c.Join(pb.JoinRequest(role="worker", flops=1.0, name="w1", device="b"), None)
        return before, gone, snapshot(c)

    before, gone, back = asyncio.run(main())
    w = {x["name"]: x for x in before["workers"]}
    assert w["w0"]["device"] == "a" and w["w0"]["link"]["region"] == "eu"
    assert w["w0"]["link"]["down_Bps"] == 2e8 and w["w0"]["link"]["server"] == "h"
    assert w["w1"]["link"]["latency_s"] == pytest.approx(0.05)  # us worker -> eu server host
    assert before["run"]["scenario"] == "two" and before["run"]["plan_method"]
    assert before["step_time"]["predicted_s"] > 0
    assert {x["name"]: x["state"] for x in gone["workers"]} == {"w0": "active", "w1": "gone"}
    assert [x["name"] for x in back["workers"]] == ["w0", "w1"] and back["workers"][1]["state"] == "active"
    events = [e["event"] for e in back["events"]]
    assert events.count("join") == 5 and "leave" in events and "replan" in events


def test_eta_is_the_steps_left_at_the_recent_step_time():
    assert eta_seconds(100, 0, []) is None  # nothing timed yet
    assert eta_seconds(100, 3, [30.0, 2.0, 4.0]) == pytest.approx(97 * 3.0)  # step 0's start-up left out
    assert eta_seconds(100, 100, [1.0]) == 0.0
    assert eta_seconds(50, 20, [9.0] + [1.0] * 10 + [3.0] * 10) == pytest.approx(30 * 3.0)  # newest 10


def test_what_a_stage_waits_for():
    base = {"stage": 1, "step": 7, "step_s": 4.0, "held": [], "unpushed": [], "wait_input": 0, "wait_grad": 0,
            "pool_todo": 0, "committing": False}
    assert stage_waits_for({**base, "step": None}) is None
    held = [{"worker": "w1", "tasks": 1, "oldest_s": 2.5}, {"worker": "w3", "tasks": 2, "oldest_s": 11.9}]
    w = stage_waits_for({**base, "held": held, "wait_input": 2})
    assert w["who"].startswith("w3 (2 tasks, leased 11.9 s ago), w1 (1 task") and w["for_s"] == 11.9
    assert stage_waits_for({**base, "committing": True, "held": held})["who"].startswith("the coordinator")
    assert stage_waits_for({**base, "unpushed": ["w2"]}) == {"who": "gradient pushes from w2", "for_s": 4.0}
    assert stage_waits_for({**base, "wait_input": 3})["who"] == "inputs from stage 0 (3 micro-batches)"
    assert stage_waits_for({**base, "wait_grad": 1})["who"] == "gradients from stage 2 (1 micro-batches)"
    assert "ready tasks" in stage_waits_for({**base, "pool_todo": 4})["who"]
    assert "other stages" in stage_waits_for(base)["who"]


def test_saved_page_holds_the_state_and_cannot_be_broken_out_of():
    from shoal.runtime.ui.dashboard import static_page

    html = static_page({"run": {"model": "</script><script>alert(1)</script>", "x": float("nan")}}).decode()
    assert "window.SHOAL_STATE = " in html and "poll()" in html
    assert html.count("</script>") == 1  # the app's own closing tag only
    state = html.split("window.SHOAL_STATE = ", 1)[1].split(";\n", 1)[0]
    assert json.loads(state)["run"] == {"model": "</script><script>alert(1)</script>", "x": None}


# --------------------------------------------------------------------------- a real launch

DEAD_AFTER = 3.0  # the runtime's default


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/state", timeout=15) as r:
        return json.loads(r.read())


def _wait(url: str, pred, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = _state(url)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {json.dumps(st)[:2000]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A 2-stage, 3-worker ``shoal launch`` with the dashboard on, long enough to outlast the tests."""
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    out = tmp_path_factory.mktemp("dash") / "run"
    cfg = LaunchConfig(out=str(out), model="tiny", stages=2, workers=3, steps=2000, micro_batches=4,
                       micro_batch_size=2, seq_len=32, warmup=2, dead_after_s=DEAD_AFTER, min_lease_s=1.5,
                       dashboard="127.0.0.1:0", timeout_s=600)
    with Swarm(cfg) as sw:
        sw.start()
        assert sw.dashboard_url.startswith("http://127.0.0.1:"), sw.dashboard_url
        _wait(sw.dashboard_url, lambda s: len(s["loss"]) >= 2, 240, "two committed steps")
        yield sw


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    msg = ("\n" + "!" * 78 + "\nSKIPPING the dashboard browser test: no chromium binary. Install Debian's "
           "package: apt-get install -y chromium (.ci/run does this when it can)\n" + "!" * 78)
    print(msg, file=sys.stderr)
    pytest.skip(msg)


def _dom(url: str, tmp_path, shot: str | None = None) -> str:
    """The page's DOM after a few polls, from a real headless Chromium (and a screenshot)."""
    exe = _chromium()
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--hide-scrollbars",
            "--virtual-time-budget=3000", "--window-size=1400,1500"]
    res = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    if shot:
        subprocess.run([*args, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    return res.stdout


def _rows(dom: str) -> dict[str, str]:
    return dict(re.findall(r'<tr class="worker \w+" data-worker="([^"]+)" data-state="(\w+)"', dom))


def _points(dom: str) -> int:
    m = re.search(r'id="loss-chart" class="chart" data-points="(\d+)"', dom)
    assert m, dom[:3000]
    return int(m.group(1))


@pytest.mark.integration
@pytest.mark.timeout(360)
def test_api_during_launch(swarm):
    """Workers, stages, servers and growing loss points in the JSON API and in ``shoal status``."""
    url = swarm.dashboard_url
    st = _wait(url, lambda s: all(w["stage"] >= 0 for w in s["workers"]) and len(s["workers"]) == 3
               and all(x["split"] for x in s["stages"]), 120, "every worker placed and every stage timed")
    assert sorted(w["name"] for w in st["workers"]) == ["w0", "w1", "w2"]
    assert all(w["state"] == "active" and w["flops"] > 0 for w in st["workers"])
    # What the workers measured, not `loopback`: device names, links to every server.
    st = _wait(url, lambda s: all(w["device"].startswith("cpu") for w in s["workers"]), 120, "measured devices")
    servers = {s["name"] for s in st["servers"]}
    for w in st["workers"]:
        link = w["link"]
        assert link["measured"] and {p["peer"] for p in link["paths"]} == servers | {"coordinator"}, link
        assert link["server"] in servers and link["server_up_Bps"] > 0 and link["rtt_s"] > 0
    assert all(s["device"].startswith("cpu") for s in st["servers"])
    assert st["run"]["eta_s"] is not None and st["run"]["eta_s"] > 0
    assert all(s["waiting_for"] and s["waiting_for"]["for_s"] >= 0 for s in st["stages"]), st["stages"]
    assert not [e for e in st["events"] if e["event"] == "join" and e.get("flops") == 1.0]
    assert [s["stage"] for s in st["stages"]] == [0, 1]
    assert st["stages"][0]["layers"][0] == 0 and st["stages"][1]["layers"][1] == 6
    assert st["stages"][0]["layers"][1] == st["stages"][1]["layers"][0]
    assert all(s["server"] and s["workers"] for s in st["stages"])
    assert sum(s["bottleneck"] for s in st["stages"]) == 1
    for s in st["stages"]:
        sp = s["split"]
        assert sp["total_s"] > 0 and sp["compute_s"] > 0
        assert sp["compute_s"] + sp["transfer_s"] + sp["sync_s"] + sp["waiting_s"] == pytest.approx(sp["total_s"])
    assert st["run"]["ready"] and st["step_time"]["achieved_s"] > 0
    assert any(e["event"] == "replan" for e in st["events"])
    n = len(st["loss"])
    done = sum(w["tasks_done"] for w in st["workers"])
    # A worker's task count arrives with its heartbeat, which may come after the commits it fed.
    st2 = _wait(url, lambda s: len(s["loss"]) >= n + 2 and sum(w["tasks_done"] for w in s["workers"]) > done,
                180, "two more committed steps and the workers' task counts grown")
    assert [p[0] for p in st2["loss"]] == list(range(len(st2["loss"])))
    assert all(w["bytes"]["wire"] > 0 for w in st2["workers"])

    env = dict(os.environ, SHOAL_TOKEN=swarm.token, SHOAL_TLS_DIR=str(swarm.tls_dir))
    res = subprocess.run([sys.executable, "-m", "shoal.cli", "status", "--join", swarm.address],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    for word in ("w0", "w1", "w2", "stages", "workers", "bottleneck", "training", "ETA"):
        assert word in res.stdout, res.stdout
    wide = subprocess.run([sys.executable, "-m", "shoal.cli", "status", "--join", swarm.address],
                          capture_output=True, text=True, timeout=120, env=dict(env, COLUMNS="300"))
    assert "waiting for" in wide.stdout and "cpu: " in wide.stdout and " rtt " in wide.stdout, wide.stdout


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_page_in_chromium_then_kill9_turns_gone(swarm, tmp_path):
    """The page in headless Chromium shows every worker and stage and a growing loss chart;
    a kill -9'd worker turns "gone" in the API within its dead-after time, then on the page."""
    url = swarm.dashboard_url
    _wait(url, lambda s: all(w["device"].startswith("cpu") for w in s["workers"]), 120, "measured devices")
    dom = _dom(url, tmp_path)
    assert _rows(dom) == {"w0": "active", "w1": "active", "w2": "active"}, dom[:3000]
    # The worker table shows the measured device names, and the links as measured.
    devices = [d for d in re.findall(r'<td class="device">([^<]*)</td>', dom) if "${" not in d]  # not the script
    assert len(devices) == 3 and all(d.startswith("cpu") for d in devices), devices
    assert "loopback" not in dom and dom.count("rtt ") >= 3
    # Loss-axis ticks at round values with the decimals their step needs (never 4 odd ones).
    ticks = [t for t in re.findall(r'<text class="tick"[^>]*>([^<]+)</text>', dom) if "${" not in t]
    assert ticks and all(len(t.split(".")[1]) <= 2 if "." in t else True for t in ticks), ticks
    assert re.search(r'id="eta">ETA [0-9.]+ (s|min|h|ms)<', dom), dom[:3000]
    assert set(re.findall(r'<tr class="stage" data-stage="(\d+)"', dom)) == {"0", "1"}
    assert len(re.findall(r'class="stage-box" data-stage="\d+"', dom)) == 2  # the plan diagram
    first = _points(dom)
    assert first >= 2
    _wait(url, lambda s: len(s["loss"]) >= first + 2, 180, "more committed steps")
    dom = _dom(url, tmp_path)
    assert _points(dom) >= first + 2

    swarm.kill_worker(2)
    killed = time.monotonic()
    st = _wait(url, lambda s: any(w["name"] == "w2" and w["state"] == "gone" for w in s["workers"]),
               DEAD_AFTER + 20, "w2 to turn gone")
    took = time.monotonic() - killed
    print(f"w2 gone {took:.2f} s after kill -9 (dead after {DEAD_AFTER} s)")
    # the coordinator's reaper declares it dead after DEAD_AFTER s of silence; the margin
    # covers its 0.1 s sweep, the heartbeat period and a loaded 2-core box
    assert took <= DEAD_AFTER + 8
    # the last kill and leave of w2 (a starved worker may have been declared dead and
    # re-joined earlier in the run)
    kill = [e for e in st["events"] if e["event"] == "kill" and e.get("device") == "w2"][-1]
    leave = [e for e in st["events"] if e["event"] == "leave" and e.get("device") == "w2"][-1]
    assert leave["why"] == "missed heartbeats"
    print(f"on the run's clock: leave {leave['time_s'] - kill['time_s']:.2f} s after the kill")
    # The page saved with a state (what the coordinator writes to RUN/dashboard.html at the
    # end) renders it from the file alone, in a real browser, with no server to poll.
    from shoal.runtime.ui.dashboard import write_page

    saved = write_page(tmp_path / "dashboard.html", _state(url))
    dom_saved = _dom(saved.as_uri(), tmp_path)
    assert _rows(dom_saved)["w2"] == "gone" and "final state, saved" in dom_saved, dom_saved[:3000]
    shot = os.environ.get("SHOAL_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
    dom = _dom(url, tmp_path, shot=shot)
    rows = _rows(dom)
    assert rows["w2"] == "gone" and rows["w0"] == "active" and rows["w1"] == "active"
    assert os.path.getsize(shot) > 10_000
