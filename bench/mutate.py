"""Mutation testing: do the tests notice small, deliberate bugs?

Two modes, both working on a temporary copy of the tree (the checkout is never touched):

* ``planted`` -- a fixed list of bugs (:data:`PLANTED`: the kind a reviewer plants by hand,
  each a textual search/replace in one file) with the tests that must catch each. Every
  mutant is run with its own pytest subprocess; the table says which survive.
* ``generated`` -- operator, comparison, boolean and constant mutants of
  ``shoal/train/optim.py`` and ``shoal/plan/cost.py`` made by a small AST walker
  (:func:`generate`). Mutants listed in ``bench/mutate_equivalent.txt`` (equivalent to the
  original: no test can tell them apart) are excluded by hand, with a reason each. To keep
  a mutant cheap, a parent process imports torch and pytest once and forks one child per
  mutant that runs the targeted tests in-process.

    nice -n 10 .venv/bin/python bench/mutate.py planted
    nice -n 10 .venv/bin/python bench/mutate.py generated [--sample N] [--file optim]
    .venv/bin/python bench/mutate.py list      # the generated mutants' keys

A mutant is *killed* when its tests fail (or time out); it *survives* when they pass.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT_FILE = ROOT / "bench" / "mutate_equivalent.txt"


@dataclass(frozen=True)
class Planted:
    """One hand-written bug: replace ``old`` (must occur exactly once) by ``new`` in ``path``."""

    name: str  # what the bug does, as a reviewer would describe it
    path: str  # file relative to the repository root
    old: str  # exact text to replace (unique in the file)
    new: str  # the buggy text
    tests: tuple[str, ...]  # pytest arguments (files, node ids, -k) that must catch it


RUNTIME_KILLS = "tests/test_runtime_faults.py"
LONE_KILL = (f"{RUNTIME_KILLS}::test_kill9_lone_worker_mid_task_forces_a_replan",)  # one swarm: a lone worker dies mid-task
UNPUSHED_KILL = f"{RUNTIME_KILLS}::test_kill9_holding_unpushed_gradients_then_between_pushes"
PARITY_3_4 = "tests/test_runtime.py::test_parity_with_local_trainer[3-4]"  # one swarm, bitwise parity
OPTIM_UNIT = ("tests/test_optim_reference.py", "-k", "not train_local")  # the fast half of the reference
# The runtime bugs are first checked by in-process unit tests of the server's pool and the
# coordinator (seconds); the swarm test after them runs only when the unit test misses the
# bug (``-x`` stops at the first failure).
POOL = "tests/test_runtime_pool.py"

PLANTED: list[Planted] = [
    Planted("apply_update ignores the clip coefficient", "shoal/train/optim.py",
            "        if coef != 1.0:\n", "        if False:\n",
            OPTIM_UNIT),
    Planted("the cosine schedule loses its min_lr floor", "shoal/train/optim.py",
            "    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))",
            "    return 0.5 * cfg.lr * (1.0 + math.cos(math.pi * progress))",
            OPTIM_UNIT),
    Planted("weight decay also applied to norm gains", "shoal/train/optim.py",
            "(decay if p.ndim >= 2 else no_decay)", "(decay if p.ndim >= 1 else no_decay)",
            OPTIM_UNIT),
    Planted("warm-up is one step late", "shoal/train/optim.py",
            "return cfg.lr * (step + 1) / cfg.warmup_steps", "return cfg.lr * step / cfg.warmup_steps",
            OPTIM_UNIT),
    Planted("clip uses the squared norm", "shoal/train/optim.py",
            "grad_clip / (math.sqrt(total_sq_norm) + 1e-6)", "grad_clip / (total_sq_norm + 1e-6)",
            OPTIM_UNIT),
    Planted("a worker's lossy push skips error feedback", "shoal/runtime/roles/worker.py",
            "encode_tensor(name, to_host(g), self._codec(\"push\"), ef=self.ef)",
            "encode_tensor(name, to_host(g), self._codec(\"push\"), ef=None)",
            ("tests/test_runtime_worker.py",)),
    Planted("a worker's local-mode pseudo-gradient push skips error feedback", "shoal/runtime/sync/local.py",
            "encode_tensor(name, delta.cpu(), codec, ef=self.pseudo_ef)",
            "encode_tensor(name, delta.cpu(), codec, ef=None)",
            ("tests/test_run_compression.py::test_worker_pseudo_gradients_carry_error_feedback_across_rounds",)),
    Planted("a pseudo-gradient covering no micro-batch is screened and merged", "shoal/runtime/sync/local.py",
            "        if covered == 0:\n            if self.local_expect",
            "        if False:\n            if self.local_expect",
            (f"{POOL}::test_local_pseudo_gradient_covering_nothing_is_no_contribution",)),
    Planted("no re-plan after a dead worker is dropped", "shoal/runtime/roles/coordinator.py",
            "            if self.ready:\n                self._replan(why)",
            "            if False:\n                self._replan(why)",
            ("tests/test_runtime_coordinator.py::test_dead_lone_worker_forces_a_replan", *LONE_KILL)),
    Planted("an expired lease deleted instead of re-queued", "shoal/runtime/roles/server.py",
            "                    del self.leases[lid]\n                    self._requeue(lease.step, lease.mb, lease.direction)\n"
            "                    changed = True",
            "                    del self.leases[lid]\n                    changed = True",
            (f"{POOL}::test_expired_lease_goes_back_to_the_pool", *LONE_KILL)),
    Planted("a voided worker's computed gradients are kept", "shoal/runtime/roles/server.py",
            "                if st.grad == \"computed\" and st.holder == wid:",
            "                if False:",
            (f"{POOL}::test_voided_worker_gives_back_its_computed_gradients", UNPUSHED_KILL)),
    Planted("the server adds the last gradient push twice", "shoal/runtime/roles/server.py",
            "for _, grads, *_ in sorted(self.pushes, key=lambda x: x[0]):",
            "for _, grads, *_ in sorted(self.pushes, key=lambda x: x[0]) + self.pushes[-1:]:",
            (f"{POOL}::test_commit_sums_each_push_once_in_micro_batch_order", PARITY_3_4)),
    Planted("the server sums pushes in arrival order", "shoal/runtime/roles/server.py",
            "for _, grads, *_ in sorted(self.pushes, key=lambda x: x[0]):",
            "for _, grads, *_ in self.pushes:",
            (f"{POOL}::test_commit_sums_each_push_once_in_micro_batch_order", PARITY_3_4)),
    Planted("a push flagged only as small strikes (honest lone workers banned)", "shoal/runtime/roles/server.py",
            "small = bool(flag) and low_only(norm, cosine, centre, self.guard_cfg)", "small = False",
            ("tests/test_guard.py::test_server_without_recomputation_bans_no_worker_for_small_pushes",)),
    Planted("launch restarts a coordinator that died after finishing", "shoal/runtime/processes/launch.py",
            "return rc not in (0, 2) and restarts_left > 0 and not run_done",
            "return rc not in (0, 2) and restarts_left > 0",
            ("tests/test_resume.py::test_launch_restarts_a_dead_coordinator_only_while_the_run_is_unfinished",)),
    Planted("the compression check accepts an untrained model (lr 1e-12)", "tests/test_compress_bench.py",
            "cfg = BenchConfig(steps=8, lr=3e-3,", "cfg = BenchConfig(steps=8, lr=1e-12,",
            ("tests/test_compress_bench.py",)),
]

# Targeted tests of the generated mutants, per file (fast unit tests only).
# The plain-PyTorch training comparison (slow) is left out: the unit tests cover the same code.
GENERATED_TARGETS: dict[str, tuple[str, ...]] = {
    "shoal/train/optim.py": ("tests/test_optim_reference.py", "-k", "not train_local"),
    "shoal/plan/cost.py": ("tests/test_plan_cost.py", "tests/test_cost_reference.py",
                           *(f"tests/test_plan_local.py::{t}" for t in (
                               "test_task_period_by_hand", "test_local_round_formulas_by_hand",
                               "test_exact_policy_with_explicit_none_codecs_is_the_default",
                               "test_local_h1_without_overlap_costs_what_exact_sync_costs",
                               "test_local_round_by_hand_and_its_amortisation",
                               "test_local_mode_counts_the_inner_optimizer_memory",
                               "test_granular_floor_by_hand", "test_expected_max_residual_and_tail_by_hand",
                               "test_pinned_pipeline_by_hand", "test_idle_queue_wait_by_hand",
                               "test_local_two_stage_prediction_is_assembled_from_the_formulas",
                               "test_vectorised_link_sharing_matches_the_list_arithmetic",
                               "test_round_sync_flows_by_hand", "test_round_traffic_by_hand",
                               "test_loopback_worker_sends_no_round_traffic",
                               "test_overlapped_round_shares_the_server_links_with_the_pipeline"))),
}


def copy_tree(dst: Path) -> Path:
    """Copy the package, the tests and the project file to ``dst`` (no caches, no .git)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in ("shoal", "tests"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _pytest_cmd(args: tuple[str, ...]) -> list[str]:
    # -n 0: one process (pyproject runs the suite in two; one targeted run per mutant needs none)
    return [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "--no-header", *args]


def run_planted(only: str | None, timeout_s: float, fast: bool = False) -> int:
    """Run every planted bug; print a Markdown table; return the number that survived."""
    survivors = 0
    print("| planted bug | file | tests | result | s |")
    print("|---|---|---|---|---|")
    for bug in PLANTED:
        if only and only not in bug.name:
            continue
        if fast and any(t.startswith(("tests/test_runtime.py", RUNTIME_KILLS)) for t in bug.tests):
            print(f"| {bug.name} | {bug.path} | {' '.join(bug.tests)} | not run (--fast) | - |")
            continue
        with tempfile.TemporaryDirectory(prefix="shoal-mutate-") as tmp:
            tree = copy_tree(Path(tmp))
            f = tree / bug.path
            text = f.read_text()
            if text.count(bug.old) != 1:
                print(f"| {bug.name} | {bug.path} | - | PATCH DOES NOT APPLY (found {text.count(bug.old)}x) | - |")
                survivors += 1
                continue
            f.write_text(text.replace(bug.old, bug.new))
            env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
                       SHOAL_TORCH_THREADS="1")
            t0 = time.monotonic()
            try:
                proc = subprocess.run(_pytest_cmd(bug.tests), cwd=tree, env=env, capture_output=True,
                                      text=True, timeout=timeout_s)
                killed = proc.returncode not in (0, 5)
                failed = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
                result = (f"caught by {failed[0].split('::', 1)[-1]}" if killed and failed else "caught" if killed
                          else ("NO TESTS RAN" if proc.returncode == 5 else "SURVIVED"))
                if proc.returncode == 5:
                    killed = False
            except subprocess.TimeoutExpired:
                killed, result = True, f"caught (timeout {timeout_s:.0f} s)"
            survivors += not killed
            print(f"| {bug.name} | {bug.path} | {' '.join(bug.tests)} | {result} | "
                  f"{time.monotonic() - t0:.0f} |", flush=True)
    return survivors


# --------------------------------------------------------------------------- generated mutants

_BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
           ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv}
_CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


@dataclass(frozen=True)
class Mutant:
    """One generated mutant: the ``index``-th mutation site of ``path``."""

    path: str  # file relative to the repository root
    line: int  # line of the mutated node in the original file
    col: str  # columns "start-end" of the mutated node
    kind: str  # binop / cmp / boolop / const / unary
    desc: str  # e.g. "+ -> -" or "2 -> 3"
    index: int  # position in the walk (stable for an unchanged file)

    @property
    def key(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.kind}:{self.desc}"


def _is_docstring(node: ast.AST, parents: dict) -> bool:
    p = parents.get(node)
    return isinstance(p, ast.Expr) and isinstance(node, ast.Constant) and isinstance(node.value, str)


def _sites(tree: ast.Module) -> list[tuple[ast.AST, str, str, object]]:
    """Mutation sites in walk order: (node, kind, description, replacement spec)."""
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    skip: set[int] = set()
    for node in ast.walk(tree):
        # annotations, decorators and default dataclass fields' comments are not behaviour
        if isinstance(node, (ast.AnnAssign,)) and node.annotation is not None:
            skip.update(id(n) for n in ast.walk(node.annotation))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in [*node.args.args, *node.args.kwonlyargs]:
                if a.annotation is not None:
                    skip.update(id(n) for n in ast.walk(a.annotation))
            if node.returns is not None:
                skip.update(id(n) for n in ast.walk(node.returns))
        if isinstance(node, ast.JoinedStr):  # error message text
            skip.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            new = _BINOPS[type(node.op)]
            out.append((node, "binop", f"{type(node.op).__name__}->{new.__name__}", new))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
            new = _CMPOPS[type(node.ops[0])]
            out.append((node, "cmp", f"{type(node.ops[0]).__name__}->{new.__name__}", new))
        elif isinstance(node, ast.BoolOp):
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            out.append((node, "boolop", f"{type(node.op).__name__}->{new.__name__}", new))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append((node, "unary", "not_x->x", None))
        elif (isinstance(node, ast.Constant) and type(node.value) in (int, float)
              and not _is_docstring(node, parents)):
            v = node.value
            new_v = (v + 1) if isinstance(v, int) else (v * 2 if v != 0 else 1.0)
            out.append((node, "const", f"{v!r}->{new_v!r}", new_v))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            out.append((node, "const", f"{node.value!r}->{not node.value!r}", not node.value))
    return out


def generate(path: str) -> list[Mutant]:
    """All generated mutants of ``path`` (relative to the repository root)."""
    tree = ast.parse((ROOT / path).read_text())
    return [Mutant(path, getattr(n, "lineno", 0), f"{getattr(n, 'col_offset', 0)}-{getattr(n, 'end_col_offset', 0)}", kind, desc, i)
            for i, (n, kind, desc, _) in enumerate(_sites(tree))]


def mutated_source(source: str, index: int) -> str:
    """``source`` with mutation site ``index`` applied (re-printed by ``ast.unparse``)."""
    tree = ast.parse(source)
    node, kind, _, spec = _sites(tree)[index]
    if kind == "binop":
        node.op = spec()
    elif kind == "cmp":
        node.ops = [spec()]
    elif kind == "boolop":
        node.op = spec()
    elif kind == "const":
        node.value = spec
    elif kind == "unary":
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        parent = parents[node]
        for field, value in ast.iter_fields(parent):
            if value is node:
                setattr(parent, field, node.operand)
            elif isinstance(value, list):
                setattr(parent, field, [node.operand if v is node else v for v in value])
    return ast.unparse(ast.fix_missing_locations(tree))


def load_equivalent() -> dict[str, str]:
    """Keys of mutants excluded by hand as equivalent -> the reason (bench/mutate_equivalent.txt)."""
    out: dict[str, str] = {}
    if EQUIVALENT_FILE.exists():
        for line in EQUIVALENT_FILE.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, why = line.partition(" ")
                out[key] = why.strip()
    return out


def _run_forked(tree: Path, args: tuple[str, ...], timeout_s: float) -> str:
    """Run pytest in a forked child (torch already imported); 'killed', 'survived' or 'timeout'."""
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.chdir(tree)
            sys.path.insert(0, str(tree))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            import pytest

            # in-process (-n 0): pyproject's addopts run the suite in xdist processes
            rc = pytest.main(["-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "no:timeout", *args])
            os._exit(int(rc))
        except BaseException:
            os._exit(99)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            if rc == 5:
                return "no tests"
            return "survived" if rc == 0 else "killed"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.05)


def _run_direct(tree: Path, files: tuple[str, ...], timeout_s: float) -> str:
    """Like :func:`_run_forked`, but the child imports the test files itself and calls every
    ``test_*`` function in file order, or the ones named ``file::name`` (for plain test
    functions: no fixtures, no parametrize).
    Skipping pytest's start-up, collection and assertion rewriting makes a mutant several
    times cheaper; pass/fail is the same (a failed assert or any exception kills)."""
    pid = os.fork()
    if pid == 0:  # child
        try:
            import importlib.util

            os.chdir(tree)
            sys.path.insert(0, str(tree))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            ran = 0
            wanted: dict[str, list[str] | None] = {}  # file -> test names (None: all of them)
            for t in files:
                f, _, name = t.partition("::")
                if not name:
                    wanted[f] = None
                elif wanted.get(f, []) is not None:
                    wanted.setdefault(f, []).append(name)
            for i, (f, names) in enumerate(wanted.items()):
                spec = importlib.util.spec_from_file_location(f"_mutant_test_{i}", tree / f)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                for name, fn in list(vars(mod).items()):
                    if name.startswith("test_") and callable(fn) and (names is None or name in names):
                        fn()
                        ran += 1
            os._exit(0 if ran else 5)
        except BaseException:
            os._exit(1)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            return "no tests" if rc == 5 else "survived" if rc == 0 else "killed"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def _run_targets(tree: Path, targets: tuple[str, ...], timeout_s: float) -> str:
    """The targeted tests of a mutant: plain test files run directly, anything else by pytest."""
    if all(t.partition("::")[0].endswith(".py") for t in targets):
        return _run_direct(tree, targets, timeout_s)
    return _run_forked(tree, targets, timeout_s)


def run_generated(files: list[str], sample: int | None, seed: int, timeout_s: float,
                  keys: set[str] | None = None) -> float:
    """Run generated mutants of ``files``; print survivors and the kill rate; return it."""
    os.environ.update(PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1")
    sys.dont_write_bytecode = True
    # Imported once in the parent, shared by the forked children (the checkout's shoal is not).
    import networkx  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import scipy.optimize  # noqa: F401
    import tokenizers  # noqa: F401
    import torch

    torch.set_num_threads(1)
    equivalent = load_equivalent()
    total_killed = total_run = 0
    with tempfile.TemporaryDirectory(prefix="shoal-mutgen-") as tmp:
        tree = copy_tree(Path(tmp))
        # The model's profile (imported by cost.py, never mutated here) loads once, from the copy.
        sys.path.insert(0, str(tree))
        import shoal.model.profile  # noqa: F401

        for path in files:
            targets = GENERATED_TARGETS[path]
            original = (tree / path).read_text()
            if _run_targets(tree, targets, timeout_s) != "survived":
                print(f"{path}: the unmutated tree fails {' '.join(targets)}; fix that first")
                return 0.0
            mutants = generate(path)
            excluded = [m for m in mutants if m.key in equivalent]
            pool = [m for m in mutants if m.key not in equivalent and (keys is None or m.key in keys)]
            if sample is not None and sample < len(pool):
                pool = sorted(random.Random(seed).sample(pool, sample), key=lambda m: m.index)
            killed, survived = 0, []
            t0 = time.monotonic()
            for m in pool:
                (tree / path).write_text(mutated_source(original, m.index))
                verdict = _run_targets(tree, targets, timeout_s)
                if verdict in ("killed", "timeout"):
                    killed += 1
                else:
                    survived.append(m)
                print(f"  {m.key}: {verdict}", flush=True)
            (tree / path).write_text(original)
            n = len(pool)
            print(f"{path}: {len(mutants)} mutants, {len(excluded)} excluded as equivalent, "
                  f"{n} run{f' (sampled, seed {seed})' if sample is not None and sample < len(mutants) else ''}, "
                  f"{killed} killed = {100 * killed / max(1, n):.1f} %  ({time.monotonic() - t0:.0f} s)")
            for m in survived:
                print(f"  SURVIVED {m.key}")
            total_killed += killed
            total_run += n
    rate = total_killed / max(1, total_run)
    print(f"total: {total_killed}/{total_run} killed = {100 * rate:.1f} %")
    return rate


def main(argv: list[str] | None = None) -> int:
    """Command line: ``planted``, ``generated`` or ``list``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("planted", help="run the fixed list of planted bugs")
    p.add_argument("--only", help="run only bugs whose name contains this text")
    p.add_argument("--timeout", type=float, default=600, help="seconds per bug (a hang counts as caught)")
    p.add_argument("--fast", action="store_true", help="skip the bugs whose tests start swarms")
    g = sub.add_parser("generated", help="AST mutants of optim.py and cost.py")
    g.add_argument("--file", choices=["optim", "cost", "both"], default="both")
    g.add_argument("--sample", type=int, help="run a random sample of this many mutants per file")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=120, help="seconds per mutant (a hang counts as killed)")
    g.add_argument("--keys", help="run only the mutants whose keys this file lists (one a line, e.g. survivors)")
    sub.add_parser("list", help="print the generated mutants' keys")
    a = ap.parse_args(argv)
    files = list(GENERATED_TARGETS)
    if a.mode == "planted":
        return 1 if run_planted(a.only, a.timeout, a.fast) else 0
    if a.mode == "list":
        for f in files:
            for m in generate(f):
                print(m.key)
        return 0
    if a.file != "both":
        files = [f for f in files if a.file in f]
    keys = None
    if a.keys:
        keys = {ln.split()[-1] if ln.strip().startswith("SURVIVED") else ln.strip()
                for ln in Path(a.keys).read_text().splitlines() if ln.strip()}
    rate = run_generated(files, a.sample, a.seed, a.timeout, keys)
    return 0 if rate >= 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
