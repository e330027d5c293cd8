"""One definition of the workload flags: same names and defaults on every training command."""

from __future__ import annotations

import dataclasses

import pytest

from shoal.cli import build_parser
from shoal.errors import ShoalError
from shoal.runtime.processes.launch import LaunchConfig
from shoal.train.config import TrainConfig
from shoal.train.flags import DEFAULTS, WORKLOAD_FIELDS, workload_from_args

COMMANDS = (["train", "--local"], ["launch", "--out", "x"], ["coordinator"], ["demo"])


def _sub(parser, name):
    for action in parser._subparsers._group_actions:
        if name in action.choices:
            return action.choices[name]
    raise AssertionError(name)


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_every_training_command_has_the_workload_flags(argv):
    sub = _sub(build_parser(), argv[0])
    flags = {s for a in sub._actions for s in a.option_strings}
    for name in WORKLOAD_FIELDS:
        assert "--" + name.replace("_", "-") in flags, (argv[0], name)


@pytest.mark.parametrize("argv", COMMANDS[:3], ids=lambda a: a[0])
def test_unset_flags_resolve_to_the_shared_defaults(argv):
    args = build_parser().parse_args(argv)
    assert workload_from_args(args) == DEFAULTS


def test_given_flags_are_applied_the_same_way_everywhere():
    extra = ["--seq-len", "64", "--micro-batch-size", "2", "--seed", "7", "--lr", "0.01"]
    got = {a[0]: workload_from_args(build_parser().parse_args(a + extra)) for a in COMMANDS[:3]}
    assert len(set(got.values())) == 1
    w = got["train"]
    assert (w.seq_len, w.micro_batch_size, w.seed, w.lr) == (64, 2, 7, 0.01)


def test_config_dataclasses_default_to_the_shared_workload():
    t, lc = TrainConfig(), LaunchConfig(out="x")
    for f in dataclasses.fields(DEFAULTS):
        assert getattr(t, f.name) == getattr(DEFAULTS, f.name), f.name
        assert getattr(lc, f.name) == getattr(DEFAULTS, f.name), f.name


def test_demo_overrides_replace_the_scenario_workload():
    from shoal.demo.cli import demo_scenario
    from shoal.plan.scenario import load_scenario

    sc, notes = demo_scenario(load_scenario("demo"), None, 12, {"seq_len": 32, "micro_batches": 3})
    assert sc.workload.seq_len == 32 and sc.workload.micro_batches == 3
    assert any("seq_len=32" in n for n in notes)


def test_bad_workload_flag_is_a_one_line_error():
    from shoal.runtime.processes.cli import _spec

    with pytest.raises(ShoalError, match="--seq-len 100000 exceeds"):
        _spec(build_parser().parse_args(["coordinator", "--seq-len", "100000"]))
