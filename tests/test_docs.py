"""The docs cannot drift from the code: links resolve, the CLI reference is the generated one,
the scenario-format reference matches the validator, and every built-in scenario named exists."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest

from shoal.errors import ShoalError
from shoal.plan import scenario as scn_mod
from shoal.plan.scenario import BUILTIN_SCENARIOS, MAX_SCALE, scenario_from_dict, scenario_to_dict

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCENARIO_MD = DOCS / "scenario-format.md"


def _doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    results = ROOT / "bench" / "results"
    if results.is_dir():
        files += sorted(results.glob("*.md"))
    return files


def _strip_code(text: str) -> str:
    """Text without fenced code blocks and inline code (links there are examples, not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces -> -)."""
    out = set()
    text = re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_relative_links_resolve():
    bad = []
    checked = 0
    for f in _doc_files():
        for target in LINK.findall(_strip_code(f.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = f if not path else f.parent / path
            checked += 1
            if not dest.exists():
                bad.append(f"{f.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{f.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 10, "the link pattern found almost nothing; is it broken?"
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_anchor_slugs_follow_github():
    md = ROOT / "docs" / "cli.md"
    assert "shoal-plan" in _anchors(md)
    assert "cli-reference" in _anchors(md)


def test_link_checker_catches_a_broken_link(tmp_path):
    f = tmp_path / "x.md"
    f.write_text("see [a](missing.md) and `[b](code.md)`\n```\n[c](block.md)\n```\n")
    targets = LINK.findall(_strip_code(f.read_text()))
    assert targets == ["missing.md"]


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_reference_is_generated():
    gen = _gen_cli()
    text = gen.generate()
    committed = (DOCS / "cli.md").read_text()
    assert committed == text, "docs/cli.md is out of date: run `python docs/gen_cli.py > docs/cli.md`"
    # Every subcommand of the real parser has a section.
    from shoal.cli import build_parser

    names = [n for n, _, _ in gen._subcommands(build_parser())]
    assert {"demo", "train", "plan", "simulate", "launch", "worker"} <= set(names)
    for n in names:
        assert f"## `shoal {n}`" in committed


SCENARIO_NAME = re.compile(r"(?<![\w-])(dtfm-\d+|gaming-[a-z]+|hetero-[a-z]+|scale-\d+)(?![\w-])")
SCENARIO_FLAG = re.compile(r"--scenario[ =]([a-z][a-z0-9-]*)(?![\w./-])")


def _is_builtin(name: str) -> bool:
    if name in BUILTIN_SCENARIOS:
        return True
    m = re.fullmatch(r"scale-(\d+)", name)
    return bool(m) and 2 <= int(m.group(1)) <= MAX_SCALE


def test_builtin_scenarios_named_in_docs_exist():
    named = set()
    for f in _doc_files():
        text = f.read_text()
        named |= {(f.name, n) for n in SCENARIO_NAME.findall(text)}
        named |= {(f.name, n) for n in SCENARIO_FLAG.findall(text)}
    assert len({n for _, n in named}) >= 10
    missing = sorted(f"{f}: {n}" for f, n in named if not _is_builtin(n))
    assert not missing, "docs name scenarios that do not exist:\n" + "\n".join(missing)
    # The reference lists every built-in.
    ref = SCENARIO_MD.read_text()
    for name in BUILTIN_SCENARIOS:
        base = re.sub(r"-\d+$", "", name) if name.startswith("dtfm") else name
        assert name in ref or base in ref, name


# ----------------------------------------------------------------- scenario-format.md


def _example() -> dict:
    blocks = re.findall(r"```json\n(.*?)```", SCENARIO_MD.read_text(), flags=re.S)
    assert blocks, "docs/scenario-format.md has no ```json example"
    return json.loads(blocks[0])


def _section(title: str) -> str:
    text = SCENARIO_MD.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"docs/scenario-format.md has no section {title!r}"
    return m.group(1)


def _table_keys(section: str) -> set[str]:
    """Backticked names in the first column of the section's tables (`a` / `b` gives both)."""
    keys = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            keys |= set(re.findall(r"`([a-z_]+)`", first))
    return keys


def test_scenario_example_loads():
    s = scenario_from_dict(_example())
    assert s.name == "my-swarm"
    assert len(s.devices) == 10 and len(s.server_hosts) == 1
    assert s.workload.micro_batches == 32
    # Human units become SI: 40 Mbit/s = 5e6 bytes/s, 10 ms = 0.01 s.
    dev = {d.id: d for d in s.devices}
    a = dev["a"]
    assert a.up == pytest.approx(5e6) and a.mean_session_s == pytest.approx(4 * 3600)
    assert s.network.link(a, dev["us-0"]).latency == pytest.approx(0.045)
    assert s.network.link(a, dev["srv"]).latency == pytest.approx(0.001)


def test_scenario_fields_documented():
    written = scenario_to_dict(scenario_from_dict(_example()))
    top = _table_keys(_section("Top level"))
    assert set(written) <= top
    assert set(written["workload"]) <= _table_keys(_section("Workload"))
    net = _table_keys(_section("Network"))
    assert set(written["network"]) <= net
    assert {"latency_ms", "bandwidth_mbps", "bandwidth_gbps"} <= net
    dev = _table_keys(_section("Devices"))
    assert set(written["devices"][0]) <= dev
    # Device fields are exactly what the validator accepts, plus the group form.
    assert dev == scn_mod._DEVICE_KEYS | {"count", "id_prefix", "template"}
    assert set(written["churn"]) <= _table_keys(_section("Churn"))


def _set(path: str, value):
    def mutate(d):
        *head, last = path.split(".")
        for k in head:
            d = d[int(k)] if k.isdigit() else d[k]
        if value is _DEL:
            del d[last]
        else:
            d[int(last) if last.isdigit() else last] = value
    return mutate


_DEL = object()

# (mutation of the example, the message start quoted in docs/scenario-format.md)
BAD = [
    (_set("network", _DEL), "scenario NAME: missing section 'network'"),
    (_set("workload.seq_len", _DEL), "scenario NAME: workload is missing seq_len"),
    (_set("workload.model", "gpt-9"), "scenario NAME: unknown model preset"),
    (_set("workload.dtype", "fp8"), "scenario NAME: dtype must be one of"),
    (_set("workload.micro_batch_size", 0), "scenario NAME: workload micro_batch_size must be a positive integer"),
    (lambda d: d["workload"].update(global_batch=10, micro_batch_size=4),
     "scenario NAME: global_batch 10 is not a multiple of micro_batch_size 4"),
    (_set("devices.0.tflops", _DEL), "devices[0]: missing tflops"),
    (_set("devices.0.speed", 1), "devices[0]: unknown field(s)"),
    (_set("devices.0.up_gbps", 1), "device a: give exactly one of up_mbps or up_gbps"),
    (_set("devices.0.tflops", -1), "device a: tflops must be >= 0"),
    (_set("devices.0.up_mbps", 0), "device a: up_mbps must be > 0"),
    (_set("devices.1.count", 0), "devices[1]: group count must be a positive integer"),
    (lambda d: d["devices"].append(dict(d["devices"][0])), "scenario NAME: device id 'a' appears twice"),
    (_set("devices.0.region", "asia"), "scenario NAME: network.intra has no link for region"),
    (lambda d: (d["network"].pop("inter"), d["network"].pop("inter_default")),
     "scenario NAME: no network link between regions"),
    (_set("network.intra.eu.latency_ms", _DEL), "network.intra.eu: missing latency_ms"),
    (lambda d: [dev.update(tflops=0) for dev in [d["devices"][0], d["devices"][1]["template"]]],
     "scenario NAME: no device has tflops > 0"),
    (_set("devices.2.can_host_server", False), "scenario NAME: no device can host a stage server"),
    (_set("churn.trace", [[1.0, "zz", "leave"]]), "scenario NAME: churn trace names unknown device"),
    (_set("churn.trace", [[1.0, "a", "quit"]]), "scenario NAME: churn trace event must be 'leave' or 'join'"),
    (_set("workload.seq_len", 4096), "scenario NAME: seq_len 4096 exceeds model"),
    (lambda d: (d["workload"].update(model="gpt-1.3b"),
                [dev.update(memory_gb=1) for dev in [d["devices"][0], d["devices"][1]["template"]]]),
     "scenario NAME: model gpt-1.3b needs"),
    (lambda d: (d["workload"].update(model="gpt-1.3b"), d["devices"][2].update(host_memory_gb=1)),
     "scenario NAME: stage servers need"),
]


@pytest.mark.parametrize("mutate,message", BAD, ids=[m for _, m in BAD])
def test_scenario_validation_messages_documented(mutate, message):
    assert f"`{message}`" in _section("Validation"), f"not quoted in docs/scenario-format.md: {message}"
    d = copy.deepcopy(_example())
    mutate(d)
    with pytest.raises(ShoalError) as exc:
        scenario_from_dict(d)
    assert str(exc.value).startswith(message.replace("NAME", d["name"])), str(exc.value)


def test_every_documented_validation_message_is_tested():
    quoted = re.findall(r"^\| [^|]+ \| `([^`]+)` \|$", _section("Validation"), flags=re.M)
    assert sorted(quoted) == sorted(m for _, m in BAD)


def test_readme_starts_with_the_two_commands():
    head = (ROOT / "README.md").read_text().splitlines()[:15]
    assert head[0] == "# shoal"
    assert "    python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/shoal demo" in head
    assert ("    python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && .venv/bin/python -m pytest"
            in head)


def test_reference_pages_stay_short():
    """The docs are reference pages a newcomer reads whole: each stays within 300 lines (split a
    page that grows past it); the CLI reference is generated from --help and is exempt."""
    long = {p.name: n for p in (ROOT / "docs").glob("*.md")
            if p.name != "cli.md" and (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"docs pages over 300 lines (split them): {long}"
