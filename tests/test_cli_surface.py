"""Every command answers ``--help``, and each command's bad input is one line
``error: ...`` with exit status 2 (no traceback), checked in-process through
:func:`shoal.cli.main`, the console script's entry point."""

from __future__ import annotations

import pytest

from shoal.cli import build_parser, main


def _commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(sub.choices)


def test_every_command_is_listed():
    assert set(_commands()) >= {"demo", "train", "generate", "plan", "simulate", "coordinator", "server",
                                "worker", "status", "launch", "data", "export"}


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in _commands())])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shoal")
    assert "--help" in out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: shoal" in capsys.readouterr().out


BAD = {  # command -> (arguments, text the error must contain); nothing here reaches the network
    "demo": (["--workers", "0"], "--workers"),
    "train": (["--local", "--steps", "0"], "--steps"),
    "generate": (["--from", "{tmp}/no-such-run"], "does not exist"),
    "plan": (["--scenario", "no-such-scenario"], "no built-in scenario"),
    "simulate": (["--scenario", "no-such-scenario"], "no built-in scenario"),
    "coordinator": (["--stages", "0"], "--stages"),
    "server": (["--join", "no-port-here"], "HOST:PORT"),
    "worker": (["--join", "127.0.0.1:1", "--codec", "zip"], "--codec"),
    "status": (["--join", "no-port-here"], "HOST:PORT"),
    "launch": (["--stages", "0"], "must be positive"),
    "keys": (["--out", "{tmp}/run", "--hosts", "not a host"], "--hosts"),
    "data": (["prepare", "{tmp}/no-such-text", "--out", "{tmp}/prepared"], "does not exist"),
    "export": (["{tmp}/no-such-run", "--format", "hf", "--out", "{tmp}/hf"], "does not exist"),
}


def test_bad_input_table_covers_every_command():
    assert set(BAD) == set(_commands())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", sorted(BAD))
def test_bad_input_is_one_line_error(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SHOAL_TOKEN", "test-token")
    args, needle = BAD[command]
    argv = [command, *[a.format(tmp=tmp_path) for a in args]]
    if command in ("demo", "train", "coordinator", "launch"):
        argv += ["--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("command", ["worker", "server"])
def test_test_only_flags_are_hidden_from_help_but_accepted(command, capsys):
    """``--inject``, ``--fault-*`` and the ``--emulate-*`` harness flags are for the tests and
    for the members ``shoal launch``/``demo`` start: not in ``--help``, still parsed."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--join" in out
    assert "--emulate" not in out and "--inject" not in out and "--fault-" not in out
    argv = [command, "--join", "h:1", "--emulate-scenario", "demo", "--emulate-device", "d0", "--emulate-jitter", "0.1"]
    if command == "worker":
        argv += ["--inject", "nan_grad", "--fault-poison", "2", "--fault-slow", "3"]
    args = build_parser().parse_args(argv)
    assert args.emulate_device == "d0" and args.emulate_jitter == 0.1
    if command == "worker":
        assert (args.inject, args.fault_poison, args.fault_slow) == ("nan_grad", 2.0, 3.0)
