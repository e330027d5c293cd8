"""``shoal launch``: a whole swarm (coordinator, S servers, W workers) as local processes.

:class:`Swarm` starts the processes on 127.0.0.1 and gives the hooks that tests and
the demo need: extra arguments per worker, ``kill_worker(i)`` (SIGKILL) and
``start_worker(...)`` mid-run, ``kill_server(stage)`` / ``start_server()``, and an
``on_event`` callback fed from the coordinator's ``events.jsonl`` and
``metrics.jsonl`` while the run goes. A coordinator that dies is restarted with
``--resume`` on the same address (``kill_coordinator()`` for tests). :func:`launch`
runs one to completion; ``LaunchConfig.resume`` continues a stopped run.
``metrics.jsonl`` while the run goes. :func:`launch` runs one to completion.
``LaunchConfig.faults`` (``--fault SPEC``) injects faults on run state (see
:mod:`shoal.runtime.safety.faults`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.data.prepare import resolve_run_data
from shoal.errors import ShoalError
from shoal.train.flags import DEFAULTS as W
from shoal.train.metrics import read_jsonl

# Default K of --ckpt-every: a server write per K steps (off its event loop); a stage server's
# loss replays at most K - 1 steps, exactly.
CKPT_EVERY = 10


def resolve_ckpt_every(given: int | None, standbys: int = 0) -> int:
    """``--ckpt-every`` as given, else 1 with hot standbys (they copy each checkpoint, so a
    promotion then loses at most the step in flight; writes are off the event loop) and
    :data:`CKPT_EVERY` without."""
    if given is not None:
        if given < 0:
            raise ShoalError(f"--ckpt-every {given} is negative; give K >= 1 (or 0 for no checkpoints)")
        return given
    return 1 if standbys > 0 else CKPT_EVERY


def resolve_ckpt_every_s(given: float | None) -> float:
    """``--ckpt-every-s`` as given, else :data:`~shoal.runtime.common.CKPT_EVERY_S` (the time
    rule of :func:`~shoal.runtime.common.ckpt_due`; 0 turns it off)."""
    if given is None:
        from shoal.runtime.common import CKPT_EVERY_S

        return CKPT_EVERY_S
    if not math.isfinite(given) or given < 0:
        raise ShoalError(f"--ckpt-every-s {given} is not a number of seconds >= 0; give T > 0 (or 0: no time rule)")
    return float(given)


# A launched swarm runs on one machine: its links are loopback, which 1 MB probes measure
# well enough (the default grows probes to 16 MB for real links' bandwidth-delay products).
LOOPBACK_PROBE = ["--probe-mb", "1"]


@dataclass
class LaunchConfig:
    """A local swarm run; model, batch and seed flags mean what they mean for ``shoal train``."""

    out: str  # run folder (runs/<run id>/ and links to the newest run's files, logs/, server_ckpt/)
    # Workload defaults are shoal.train.flags.Workload's, the same as shoal train --local's.
    model: str = W.model  # model preset
    stages: int = 2  # pipeline stages S (one server each; with replicas: set to all replicas' stages)
    replicas: str = ""  # local mode: pipeline replicas, stages per replica (shoal.runtime.sync.replicas; "": one pipeline)
    replica_file: str = ""  # (set by validate) the plan file --replicas named: the coordinator reads its worker placement
    workers: int | None = None  # workers started at launch (None: 2, or every scenario worker)
    steps: int = W.steps  # optimizer steps
    micro_batches: int = W.micro_batches  # M micro-batches per step
    micro_batch_size: int = W.micro_batch_size  # sequences per micro-batch
    seq_len: int = W.seq_len  # tokens per sequence
    seed: int = W.seed  # weights and data seed
    lr: float = W.lr  # peak learning rate
    min_lr: float | None = W.min_lr  # final learning rate (None: lr / 10, as shoal train)
    warmup: int = W.warmup  # warm-up steps
    weight_decay: float = W.weight_decay  # AdamW weight decay
    grad_clip: float = W.grad_clip  # global grad-norm clip
    ckpt_every: int | None = None  # servers checkpoint every K committed steps (None: resolve_ckpt_every)
    ckpt_every_s: float | None = None  # and once T s of committed work are in no checkpoint (None: resolve_ckpt_every_s)
    dead_after_s: float = 3.0  # a member silent this long is dead
    min_lease_s: float = 2.0  # shortest lease without renewal
    data: str | tuple[str, ...] = "corpus"  # "corpus", "synthetic", a prepared folder or raw text paths
    init_from: str | None = None  # Hugging Face Llama folder the run starts from (sets the model shape)
    ordered_grads: bool = True  # one gradient push per micro-batch, summed in order (bitwise parity)
    chunk_mb: float | None = None  # MB per chunk of streamed transfers (None: shoal.net.stream's default)
    min_workers: int | None = None  # workers needed before step 0 (None: all launched)
    worker_args: list[list[str]] = field(default_factory=list)  # extra CLI args per worker index
    token: str | None = None  # join token (None: SHOAL_TOKEN or a random one)
    timeout_s: float = 600.0  # give up after this long
    scenario: str | None = None  # scenario name/file: each process emulates one of its devices
    emulate_speedup: float = 1.0  # scenario compute time scale (see shoal.emulate.pacing)
    latency_scale: float = 1.0  # scenario latencies are multiplied by this
    bandwidth_scale: float = 1.0  # scenario bandwidths are multiplied by this
    dashboard: str | None = None  # HOST:PORT of the coordinator's web dashboard (None: none)
    tensorboard: str | None = None  # folder for TensorBoard event files of the step metrics (None: none)
    device: str = "auto"  # --device of every worker (auto: the first CUDA device, else the CPU)
    precision: str = "fp32"  # compute precision of the run: fp32, bf16 or fp16
    loss_scale: float | None = None  # fp16: initial dynamic loss scale (None: the default)
    resume: bool = False  # continue the newest run in `out` (or `run_id`) from its journal; run settings ignored
    run_id: str | None = None  # with resume: the run to continue (None: the newest)
    coordinator_restarts: int = 3  # a coordinator that dies (not a failed run) is restarted with --resume this often
    sync: str = "exact"  # sync policy: exact, or local (DiLoCo inside each stage; shoal.train.outer)
    sync_every: int = 32  # local: steps between merges H
    outer_lr: float = 1.0  # local: outer Nesterov learning rate
    outer_momentum: float = 0.0  # local: outer Nesterov momentum
    overlap: bool = True  # local: a round's merge runs while the next round computes (False: the steps wait for it)
    lean: bool = False  # local: workers hold 12 B a parameter (--lean-workers; shoal.runtime.sync.lean)
    compression: str = "none"  # wire codecs per traffic kind (shoal.runtime.sync.codecs; none: uncompressed)
    faults: list[str] = field(default_factory=list)  # --fault SPECs (shoal.runtime.safety.faults grammar)
    spot_check: float = 0.05  # fraction of gradient pushes the stage servers recompute (exact runs)
    server_checks: bool = False  # exact runs: the servers recompute drawn pushes themselves, no worker does (--server-checks)
    standbys: int = 0  # hot standby servers, each with its own empty checkpoint folder (stage k mod S)
    tls: bool = True  # mutual TLS with keys made in RUN/tls (False: plain text on loopback)
    fork_server: bool = True  # fork members from one warm process (shoal.runtime.processes.forkserver; False: spawn each)
    session: bool | None = None  # workers talk to their stage server on one session stream (None: in exact sync; False: a call per message)
    shadow: bool = False  # shadow workers (shoal.runtime.roles.shadow): no model run; needs a scenario
    shadow_per_process: int = 64  # shadow workers that play one device share a process, this many at most
    merge_memory_gb: float | None = None  # GB of decoded pseudo-gradients a server's merge holds (None: its default)

    def validate(self) -> None:
        if self.workers is None:
            self.workers = 2
        if self.replicas:
            self.stages = sum(self._replica_plan()[0])  # (a plan file becomes its SPEC here)
        if self.stages < 1 or self.workers < 1 or self.steps < 1:
            raise ShoalError("--stages, --workers and --steps must be positive")
        resolve_ckpt_every_s(self.ckpt_every_s)
        if self.workers < self.stages and (self.min_workers or self.workers) < self.stages:
            raise ShoalError(f"--workers {self.workers} < --stages {self.stages}: every stage needs a worker")
        from shoal.train.outer import SyncConfig

        SyncConfig(self.sync, self.sync_every, self.outer_lr, self.outer_momentum, self.overlap,
                   self.lean).validate(self.precision)
        from shoal.runtime.sync.codecs import parse_run_compression

        self.compression = parse_run_compression(self.compression).text()
        from shoal.train.precision import check_device_precision, check_precision, resolve_device

        # Checked here, once, so a bad --device is one line before any process starts.
        check_device_precision(resolve_device(self.device), check_precision(self.precision))
        if not 0.0 <= self.spot_check <= 1.0:
            raise ShoalError(f"--spot-check must be a fraction between 0 and 1, got {self.spot_check}")
        if self.shadow and not self.scenario:
            raise ShoalError("--shadow workers wait their emulated device's task time: give --scenario")
        from shoal.runtime.roles.shadow import check_shadow_sync

        check_shadow_sync(self.shadow, self.sync != "exact")
        from shoal.runtime.sync.held import merge_memory_bytes

        merge_memory_bytes(self.merge_memory_gb)
        if self.shadow_per_process < 1:
            raise ShoalError(f"--shadow-per-process must be at least 1, got {self.shadow_per_process}")
        if self.replicas and self.sync != "local":
            raise ShoalError("--replicas needs --sync local (replicas merge at the rounds of local mode)")

    def _replica_plan(self) -> tuple[list[int], list[int]]:
        """(stages, micro-batches) of each replica of ``--replicas`` (a one-line ShoalError when bad)."""
        from shoal.runtime.sync.replicas import parse_replicas, resolve_replicas

        if self.init_from:
            from shoal.hf.convert import read_hf_model_config

            cfg = read_hf_model_config(str(Path(self.init_from).expanduser().resolve()))
        else:
            from shoal.model.config import get_preset

            cfg = get_preset(self.model)
        if self.replicas.endswith(".json"):
            self.replica_file = str(Path(self.replicas).expanduser().resolve())
        self.replicas = resolve_replicas(self.replicas, self.micro_batches, cfg.n_total_layers)
        return parse_replicas(self.replicas, self.micro_batches, cfg.n_total_layers)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["SHOAL_TORCH_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Swarm:
    """The processes of one local run."""

    def __init__(self, cfg: LaunchConfig, on_event: Callable[[dict], None] | None = None):
        self.scenario = None
        if cfg.scenario:
            from shoal.plan.scenario import load_scenario

            self.scenario = load_scenario(cfg.scenario)
            if not self.scenario.workers or not self.scenario.server_hosts:
                raise ShoalError(f"scenario {cfg.scenario} needs worker devices and a server host")
            if cfg.workers is None:
                cfg.workers = len(self.scenario.workers)
        self.run_id = ""  # the run's id, once its coordinator has started
        self.run_data = "corpus"  # the run's data source; a prepared folder goes to every stage server
        if cfg.resume:
            self._from_journal(cfg)
        cfg.validate()
        from shoal.runtime.safety.faults import check_faults, parse_fault

        self.faults = [parse_fault(f) for f in cfg.faults]
        check_faults(self.faults, workers=cfg.workers, stages=cfg.stages, steps=cfg.steps,
                     ckpt_every=resolve_ckpt_every(cfg.ckpt_every, cfg.standbys),
                     ckpt_every_s=resolve_ckpt_every_s(cfg.ckpt_every_s))
        self._pending_faults = [f for f in self.faults if hasattr(f, "step")]  # fired on run state
        self.proxies: dict[str, list] = {}  # worker name -> its FlapProxy per stage server (flap faults)
        self.cfg, self.on_event = cfg, on_event
        self.out = Path(cfg.out)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "logs").mkdir(exist_ok=True)
            probe = self.out / "logs" / ".writable"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ShoalError(f"run folder {self.out} is not writable ({exc.strerror or exc}); "
                             f"give a writable --out") from None
        self.token = cfg.token or os.environ.get("SHOAL_TOKEN") or secrets.token_hex(16)
        # Owner-only, so a person can add members (`--token-file RUN/token`) and nobody else reads it.
        self.token_file = self.out / "token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(self.token + "\n")
        # The server token admits stage servers and standbys (the join token admits workers only):
        # the coordinator and servers get it, workers never do.
        kept = self.out / "server_token"
        self.server_token = (os.environ.get("SHOAL_SERVER_TOKEN")
                             or (kept.read_text().strip() if cfg.resume and kept.is_file() else "")
                             or secrets.token_hex(16))
        fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(self.server_token + "\n")
        self.env = _env()
        self.env["SHOAL_TOKEN"] = self.token
        self.env["SHOAL_SERVER_TOKEN"] = self.server_token
        self.tls = None  # the run's certificates (None: plain text, --insecure)
        self.tls_dir: Path | None = None
        if cfg.tls:
            self.tls_dir, self.tls = run_keys(self.out / "tls")
            # Members read SHOAL_TLS_DIR, so members a person adds by hand with this env find the keys too.
            self.env["SHOAL_TLS_DIR"] = str(self.tls_dir)
        else:
            self.env.pop("SHOAL_TLS_DIR", None)
        self.coord: subprocess.Popen | None = None
        self.servers: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen | None] = []
        self._members: list[subprocess.Popen] = []  # every member this swarm started, in start order
        self._stopped = False  # set by stop(): no member starts after it
        self.address = ""
        self._seen = {"events.jsonl": 0, "metrics.jsonl": 0}
        self._n_server = 0
        self.t0 = time.time()
        self.run_t0: float | None = None  # the coordinator's t0 (the run's clock), once it has started
        self.server_ports: list[int] = []
        self.peers: dict[str, str] = {}  # server address -> scenario host id (emulation)
        self.dashboard_url = ""  # the coordinator's dashboard, once started with cfg.dashboard
        self.restarts_left = cfg.coordinator_restarts

    def _from_journal(self, cfg: LaunchConfig) -> None:
        """``resume``: the stage, step and worker counts of the run being continued."""
        from shoal.runtime.safety.journal import load_resume

        out, self.run_id, state = load_resume(cfg.out, cfg.run_id)
        cfg.out = str(out)  # RUN_DIR may name the run's own folder, OUT/runs/<id>
        cfg.stages, cfg.steps = int(state.spec["stages"]), int(state.spec["steps"])
        cfg.min_workers = int(state.options.get("min_workers") or cfg.stages)
        cfg.workers = cfg.workers or cfg.min_workers
        self.run_data = str(state.spec.get("data") or "corpus")

    def _spawn(self, args: list[str], log_name: str, env: dict | None = None) -> subprocess.Popen:
        """Start a member in its own session, forked from the warm fork server unless that is off."""
        from shoal.runtime.processes.forkserver import spawn_member

        security = [] if self.tls is not None else ["--insecure"]
        env = dict(env or self.env)
        if not self.cfg.fork_server:
            env["SHOAL_FORK_SERVER"] = "0"
        # A Ctrl-C between the fork and the handle's registration would leave a member no
        # stop() can reach: interrupts wait until the handle is in self._members.
        with _signals_deferred():
            if self._stopped:
                raise ShoalError(f"this swarm has stopped; no {args[0]} starts in {self.out}")
            p = spawn_member([args[0], *security, *args[1:]], self.out / "logs" / f"{log_name}.log", env)
            self._members.append(p)
            if self._stopped:  # a churn thread's start raced stop(), whose list may lack it
                p.kill()
                raise ShoalError(f"this swarm has stopped; the {args[0]} just started in {self.out} was killed")
        return p

    def _vocab(self) -> int:
        if self.cfg.init_from:
            from shoal.hf.convert import read_hf_model_config

            return read_hf_model_config(self.cfg.init_from).vocab_size
        from shoal.model.config import get_preset

        return get_preset(self.cfg.model).vocab_size

    def start(self) -> None:
        """Start the coordinator, S servers and the workers; return once the address is known."""
        c = self.cfg
        self.t0 = time.time()
        if c.fork_server:  # start its imports now; they overlap the data preparation below
            from shoal.runtime.processes.forkserver import get_fork_server

            get_fork_server(self.env)
        if c.resume:
            # The run's settings come from its journal; a new port (every member is new).
            self._start_coordinator(["--resume", str(self.out), "--run-id", self.run_id,
                                     "--listen", "127.0.0.1:0"])
        else:
            self._start_coordinator(self._run_flags())
        if self.scenario is not None:
            # Servers listen on ports fixed now, so every process knows which scenario
            # host is behind which address (its links are shaped accordingly).
            hosts = self.scenario.server_hosts
            self.server_ports = [_free_port() for _ in range(c.stages)]
            self.peers = {f"127.0.0.1:{p}": hosts[i % len(hosts)].id for i, p in enumerate(self.server_ports)}
        elif self._flaps():
            # Fixed ports, so a flapping worker's proxies know their targets before the servers start.
            self.server_ports = [_free_port() for _ in range(c.stages)]
        for _ in range(c.stages):
            self.start_server()
        for _ in range(c.standbys):
            self.start_server(standby=True)
        if c.shadow:
            self._start_shadow_workers()
        else:
            for i in range(c.workers):
                self.start_worker(i)

    def _start_shadow_workers(self) -> None:
        """Shadow workers, grouped: consecutive workers that play equal devices (all but the
        id) share a process (at most ``shadow_per_process``), all playing the group's first
        device (the coordinator plans on a copy of it per member); worker ``k`` of the group of
        process ``w<first>`` is named ``w<first>-<k>``. ``kill_worker(i)`` kills its whole group."""
        from dataclasses import replace

        c = self.cfg
        devs = [self.scenario.workers[i % len(self.scenario.workers)] for i in range(c.workers)]
        i = 0
        while i < c.workers:
            n = 1
            while (i + n < c.workers and n < c.shadow_per_process
                   and replace(devs[i + n], id="") == replace(devs[i], id="")):
                n += 1
            self.start_worker(i, extra=["--count", str(n)])
            while len(self.workers) < i + n:
                self.workers.append(self.workers[i])
            i += n

    def _run_flags(self) -> list[str]:
        """The coordinator flags of a new run (``shoal coordinator``)."""
        c = self.cfg
        min_lr = c.lr / 10 if c.min_lr is None else c.min_lr
        # Raw text is prepared once here, into the run folder; the processes get the folder.
        data = self.run_data = resolve_run_data(c.data, self.out, self._vocab())
        model_args = ["--init-from", str(Path(c.init_from).resolve())] if c.init_from else ["--model", c.model]
        return [
            "--listen", "127.0.0.1:0", *model_args, "--stages", str(c.stages),
            *(["--replicas", c.replica_file or c.replicas] if c.replicas else []),
            "--min-workers", str(c.min_workers or c.workers), "--steps", str(c.steps),
            "--micro-batches", str(c.micro_batches), "--micro-batch-size", str(c.micro_batch_size),
            "--seq-len", str(c.seq_len), "--seed", str(c.seed), "--lr", repr(c.lr), "--min-lr", repr(min_lr),
            "--warmup", str(c.warmup), "--weight-decay", repr(c.weight_decay), "--grad-clip", repr(c.grad_clip),
            "--ckpt-every", str(resolve_ckpt_every(c.ckpt_every, c.standbys)),
            "--ckpt-every-s", repr(resolve_ckpt_every_s(c.ckpt_every_s)), "--dead-after", repr(c.dead_after_s),
            "--min-lease", repr(c.min_lease_s), "--data", data, "--out", str(self.out),
            *([] if c.ordered_grads else ["--unordered-grads"]),
            *([] if c.chunk_mb is None else ["--chunk-mb", repr(c.chunk_mb)]),
            "--precision", c.precision, *([] if c.loss_scale is None else ["--loss-scale", repr(c.loss_scale)]),
            "--sync", c.sync, "--sync-every", str(c.sync_every), "--outer-lr", repr(c.outer_lr),
            "--outer-momentum", repr(c.outer_momentum), *([] if c.overlap else ["--no-overlap"]),
            *(["--lean-workers"] if c.lean else []),
            "--spot-check", repr(c.spot_check), *(["--server-checks"] if c.server_checks else []),
            "--compression", c.compression, *(["--shadow"] if c.shadow else []),
            *self._coordinator_emulation()]

    def _start_coordinator(self, args: list[str]) -> None:
        """Start the coordinator with ``args`` (plus the address file and dashboard); wait for its address."""
        c = self.cfg
        addr_file = self.out / "logs" / "coordinator.address"
        for suffix in ("", ".dashboard", ".t0", ".run_id"):
            Path(str(addr_file) + suffix).unlink(missing_ok=True)
        self.coord = self._spawn(["coordinator", *args, "--address-file", str(addr_file),
                                  *(["--dashboard", c.dashboard] if c.dashboard else []),
                                  *(["--tensorboard", str(Path(c.tensorboard).expanduser().resolve())]
                                    if c.tensorboard else [])], "coordinator")
        deadline = time.time() + 60
        while not addr_file.exists():
            if self.coord.poll() is not None:
                why = self.coordinator_error()
                raise ShoalError(f"the coordinator exited at start{f' ({why})' if why else ''}; "
                                 f"see {self.out / 'logs' / 'coordinator.log'}")
            if time.time() > deadline:
                raise ShoalError("the coordinator did not start within 60 s")
            time.sleep(0.05)
        self.address = addr_file.read_text().strip()
        t0_file = Path(str(addr_file) + ".t0")
        if t0_file.exists():
            self.run_t0 = float(t0_file.read_text())
        web_file = Path(str(addr_file) + ".dashboard")
        if c.dashboard and web_file.exists():  # written before the address
            self.dashboard_url = web_file.read_text().strip()
        id_file = Path(str(addr_file) + ".run_id")
        if id_file.exists():
            self.run_id = id_file.read_text().strip()

    def kill_coordinator(self) -> None:
        """kill -9 the coordinator (:meth:`wait` restarts it with ``--resume``)."""
        if self.coord is not None and self.coord.poll() is None:
            os.kill(self.coord.pid, signal.SIGKILL)
            self.coord.wait()
            self._log_kill("coordinator", "coordinator")

    def restart_coordinator(self) -> None:
        """Start the run's coordinator again with ``--resume`` on the same address.

        The members keep running: they ride out the outage (heartbeats and joins are
        retried for ``orphan_after_s``), join the new coordinator, and the run rolls back
        to the newest step every stage checkpointed.
        """
        self.restarts_left -= 1
        rc = self.coord.returncode if self.coord is not None else None
        self._start_coordinator(["--resume", str(self.out), "--run-id", self.run_id, "--listen", self.address])
        from shoal.train.metrics import JsonlWriter

        with JsonlWriter(self.out / "events.jsonl", t0=self.run_t0 or self.t0) as w:
            w.event("coordinator_restart", exit=rc, address=self.address)

    def _should_restart(self) -> bool:
        """Whether a coordinator that exited died (restart it) rather than ended the run."""
        rc = self.coord.returncode
        # The journal is read only for a death (rc 0 and 2 end the run whatever it says).
        return bool(self.run_id) and should_restart(rc, self.restarts_left,
                                                    run_done=rc not in (0, 2) and self._run_done())

    def _run_done(self) -> bool:
        """Whether this run's journal says the run finished."""
        from shoal.runtime.safety.journal import read_journal, resume_state, run_dir

        try:
            return resume_state(read_journal(run_dir(self.out, self.run_id) / "journal.jsonl")).state == "done"
        except (OSError, ShoalError):
            return False

    def start_server(self, standby: bool = False) -> int:
        """Start a stage server (it takes the first vacant stage); returns its index.

        ``standby``: a hot standby on its own checkpoint folder (``standby_ckpt/s<i>``).
        """
        i = self._n_server
        self._n_server += 1
        listen, emu = "127.0.0.1:0", []
        if self.scenario is not None:
            hosts = self.scenario.server_hosts
            port = self.server_ports[i] if i < len(self.server_ports) else _free_port()
            listen = f"127.0.0.1:{port}"
            self.peers[listen] = hosts[i % len(hosts)].id
            emu = self._emulation(hosts[i % len(hosts)].id)
        elif i < len(self.server_ports):
            listen = f"127.0.0.1:{self.server_ports[i]}"
        ckpt = self.out / "standby_ckpt" / f"s{i}" if standby else self.out / "server_ckpt"
        self.servers.append(self._spawn(["server", "--join", self.address, "--listen", listen,
                                         "--ckpt-dir", str(ckpt), "--name", f"s{i}",
                                         *(["--standby"] if standby else []), *self._server_data(),
                                         *([] if self.cfg.merge_memory_gb is None
                                           else ["--merge-memory-gb", repr(self.cfg.merge_memory_gb)]),
                                         *LOOPBACK_PROBE, *emu],
                                        f"server{i}"))
        return i

    def _server_data(self) -> list[str]:
        """``--data DIR`` for a stage server when the run trains on a prepared folder (on one
        machine every server reads the coordinator's folder)."""
        return [] if self.run_data in ("corpus", "synthetic") else ["--data", self.run_data]

    def _coordinator_emulation(self) -> list[str]:
        """Flags telling the coordinator which scaled scenario to plan on (none: loopback)."""
        c = self.cfg
        if self.scenario is None:
            return []
        return ["--emulate-scenario", c.scenario, "--emulate-speedup", repr(c.emulate_speedup),
                "--emulate-latency-scale", repr(c.latency_scale),
                "--emulate-bandwidth-scale", repr(c.bandwidth_scale)]

    def _emulation(self, device: str) -> list[str]:
        from shoal.emulate.hooks import EmulationConfig

        c = self.cfg
        return EmulationConfig(
            scenario=c.scenario, device=device, speedup=c.emulate_speedup, latency_scale=c.latency_scale,
            bandwidth_scale=c.bandwidth_scale, peers=dict(self.peers), seed=c.seed,
            default_peer=self.scenario.server_hosts[0].id).to_args()

    def start_worker(self, i: int | None = None, extra: list[str] | None = None) -> int:
        """Start worker ``i`` (default: a new index) with its configured and ``extra`` args."""
        if i is None:
            i = len(self.workers)
        args = list(self.cfg.worker_args[i]) if i < len(self.cfg.worker_args) else []
        if self.scenario is not None:
            dev = self.scenario.workers[i % len(self.scenario.workers)]
            args += [*self._emulation(dev.id), "--flops", repr(dev.flops * self.cfg.emulate_speedup)]
        args += self._fault_args(f"w{i}")
        if self.cfg.session is not None:
            args.append("--session" if self.cfg.session else "--no-session")
        if self.cfg.shadow:
            args.append("--shadow")
        args += extra or []
        if "--probe-mb" not in args:
            args += LOOPBACK_PROBE
        p = self._spawn(["worker", "--join", self.address, "--name", f"w{i}", "--device", self.cfg.device, *args],
                        f"worker{i}", env={k: v for k, v in self.env.items() if k != "SHOAL_SERVER_TOKEN"})
        while len(self.workers) <= i:
            self.workers.append(None)
        self.workers[i] = p
        return i

    def kill_worker(self, i: int) -> None:
        """kill -9 worker ``i``."""
        p = self.workers[i]
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            self._log_kill(f"w{i}", "worker")

    def kill_server(self, i: int) -> None:
        """kill -9 server process ``i`` (index in start order)."""
        p = self.servers[i]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            self._log_kill(f"s{i}", "server")

    # ------------------------------------------------------------------ fault injection
    def _flaps(self) -> list:
        from shoal.runtime.safety.faults import FlapFault

        return [f for f in self.faults if isinstance(f, FlapFault)]

    def _fault_args(self, worker: str) -> list[str]:
        """Worker flags of its faults; a flapping worker dials the servers through its proxies."""
        from shoal.emulate.flap import FlapProxy
        from shoal.runtime.safety.faults import worker_fault_args

        args = worker_fault_args(self.faults, worker)
        for f in self._flaps():
            if f.worker != worker or not self.server_ports:
                continue
            for p in self.proxies.pop(worker, []):
                p.close()
            targets = [f"127.0.0.1:{port}" for port in self.server_ports]
            self.proxies[worker] = [FlapProxy(t, f.period_s, f.down_s, f.for_s).start() for t in targets]
            for t, p in zip(targets, self.proxies[worker], strict=True):
                args += ["--dial-map", f"{t}={p.address}"]
        return args

    def _fault_event(self, **fields) -> None:
        from shoal.train.metrics import JsonlWriter

        with JsonlWriter(self.out / "events.jsonl", t0=self.run_t0 or self.t0) as w:
            w.event("fault", **fields)

    def _stage_server_index(self, stage: int) -> int | None:
        """Start-order index of the server the newest plan gave ``stage`` (None: none yet)."""
        names = [e["device"] for e in read_jsonl(self.out / "events.jsonl")
                 if e.get("event") == "assign" and e.get("role") == "server" and e.get("stage") == stage]
        return int(names[-1][1:]) if names else None

    def _run_id(self) -> str:
        runs = [e for e in read_jsonl(self.out / "events.jsonl") if e.get("event") == "run" and e.get("run_id")]
        return runs[-1]["run_id"] if runs else ""

    def fault_tick(self) -> None:
        """Fire the faults whose step has been committed (called while waiting for the run)."""
        if not self._pending_faults:
            return
        committed = self.committed_steps()
        for f in [f for f in self._pending_faults if committed >= f.step]:
            self._pending_faults.remove(f)
            self._fire(f, committed)

    def _fire(self, f, committed: int) -> None:
        from shoal.runtime.common import ckpt_dir
        from shoal.runtime.safety.faults import (
            CorruptCkptFault,
            KillFault,
            corrupt_file,
            newest_ckpt,
        )

        if isinstance(f, KillFault) and f.role == "worker":
            live = [i for i, p in enumerate(self.workers) if p is not None and p.poll() is None]
            i = int(f.name[1:]) if f.name else (live[-1] if live else None)
            self._fault_event(kind="kill", target=f"w{i}", step=committed)
            if i is not None:
                self.kill_worker(i)
        elif isinstance(f, KillFault) and f.role == "coordinator":
            self._fault_event(kind="kill", target="coordinator", step=committed)
            self.kill_coordinator()  # wait() restarts it with --resume on the same address
        elif isinstance(f, KillFault):
            i = int(f.name[1:]) if f.name else self._stage_server_index(self.cfg.stages - 1)
            self._fault_event(kind="kill", target=f"s{i}", step=committed)
            if i is not None:
                self.kill_server(i)
                self.start_server()  # a replacement on the same checkpoint folder
        elif isinstance(f, CorruptCkptFault):
            folder = ckpt_dir(self.out / "server_ckpt", f.stage, self._run_id())
            if newest_ckpt(folder) is None:
                self._pending_faults.append(f)  # fires once the stage has a checkpoint to corrupt
                return
            i = self._stage_server_index(f.stage)
            if i is not None:
                self.kill_server(i)  # first, so it writes no newer checkpoint
            path = newest_ckpt(folder)
            if path is not None:
                corrupt_file(path)
            self._fault_event(kind="corrupt-ckpt", stage=f.stage, step=committed,
                              path=str(path) if path else "", target=f"s{i}" if i is not None else "")
            self.start_server()

    def _event(self, rec: dict) -> None:
        if self.on_event:
            self.on_event(rec)

    def _log_kill(self, device: str, role: str) -> None:
        """Record a kill in events.jsonl (appended as one line beside the coordinator's).

        Stamped on the coordinator's clock (its ``t0``), like its own events and metrics.
        """
        from shoal.train.metrics import JsonlWriter

        with JsonlWriter(self.out / "events.jsonl", t0=self.run_t0 or self.t0) as w:
            w.event("kill", device=device, role=role, signal="SIGKILL")

    def poll_records(self) -> list[dict]:
        """New events and metrics records since the last call (also sent to ``on_event``)."""
        new = []
        for fname in ("events.jsonl", "metrics.jsonl"):
            recs = read_jsonl(self.out / fname)
            for r in recs[self._seen[fname]:]:
                r = dict(r)
                r.setdefault("event", "step")
                new.append(r)
                self._event(r)
            self._seen[fname] = len(recs)
        return new

    def status(self) -> dict:
        """The coordinator's live status (see :func:`swarm_status`)."""
        return swarm_status(self.address, self.token, tls=self.tls)

    def committed_steps(self) -> int:
        return len({r["step"] for r in read_jsonl(self.out / "metrics.jsonl")})  # a ban's undo redoes steps

    def wait(self, timeout_s: float | None = None) -> dict:
        """Wait for the coordinator to finish; return the run summary."""
        deadline = time.time() + (timeout_s or self.cfg.timeout_s)
        while self.coord.poll() is None or self._should_restart():
            if self.coord.poll() is not None:
                try:
                    self.restart_coordinator()
                except ShoalError:
                    # A coordinator that died just after finishing: its journal may say "done"
                    # only by now (the resumed one refused for that reason); the run is complete.
                    if self._run_done():
                        break
                    raise
                continue
            if time.time() > deadline:
                self.stop()
                raise ShoalError(f"run did not finish within {timeout_s or self.cfg.timeout_s:.0f} s; "
                                 f"see the logs in {self.out / 'logs'}")
            self.poll_records()
            self.fault_tick()
            time.sleep(0.1)
        self.poll_records()
        self._report_unfired()
        summary_path = self.out / "summary.json"
        rc = self.coord.returncode
        # 2 is a one-line error (a failed run) whatever the journal says, except from a coordinator
        # restarted after the first one died in its teardown: that one refuses a finished run
        # (its journal says "done" by the time it reads it). Another status after a journaled
        # "done" is a death in teardown. Either way the run is complete.
        restarted = self.restarts_left < self.cfg.coordinator_restarts
        if ((rc not in (0, 2) or (rc == 2 and restarted)) and summary_path.exists() and self.run_id
                and self._run_done()):
            print(f"warning: the coordinator exited with status {rc} after the run finished; "
                  f"the run is complete (see {self.out / 'logs' / 'coordinator.log'})", file=sys.stderr)
        elif rc != 0 or not summary_path.exists():
            self.stop()
            why = self.coordinator_error()
            raise ShoalError(f"{why or f'the coordinator failed (exit {self.coord.returncode})'}; "
                             f"see {self.out / 'logs' / 'coordinator.log'}")
        # Members exit by themselves once they see "done"; give them a moment.
        end = time.time() + 5
        for p in [*self.servers, *[w for w in self.workers if w]]:
            while p.poll() is None and time.time() < end:
                time.sleep(0.05)
        self.stop()
        return json.loads(summary_path.read_text())

    def _report_unfired(self) -> None:
        """Say which faults never fired (the run ended first): a line on stderr and a
        ``fault_not_fired`` event, never silence (a corrupt-ckpt waits for a checkpoint that
        the time rule may not write in a short run)."""
        from shoal.runtime.safety.faults import CorruptCkptFault

        for f in self._pending_faults:
            if isinstance(f, CorruptCkptFault):
                why = (f"stage {f.stage} wrote no checkpoint before the run ended (--ckpt-every "
                       f"{resolve_ckpt_every(self.cfg.ckpt_every, self.cfg.standbys)}, --ckpt-every-s "
                       f"{resolve_ckpt_every_s(self.cfg.ckpt_every_s):g}); nothing was corrupted")
                name = f"corrupt-ckpt:{f.stage}:step={f.step}"
            else:  # a kill: the run finished before its step was committed
                why = f"the run ended before {f.step} steps were committed"
                name = f"kill:{f.role}{':' + f.name if getattr(f, 'name', None) else ''}:step={f.step}"
            print(f"warning: --fault {name} did not fire: {why}", file=sys.stderr)
            self._fault_event(kind="not_fired", fault=name, why=why)
        self._pending_faults = []

    def coordinator_error(self) -> str:
        """The coordinator's one-line ``error: ...`` (a failed run), or ""."""
        log = self.out / "logs" / "coordinator.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        errors = [ln[len("error: "):] for ln in lines if ln.startswith("error: ")]
        return errors[-1] if errors else ""

    def stop(self) -> None:
        """Kill every process still running (and close the flap proxies)."""
        self._stopped = True  # before the list is read: a start racing this kills its own member
        procs = [*[w for w in self.workers if w], *self.servers, *([self.coord] if self.coord else [])]
        procs += [p for p in self._members if all(p is not q for q in procs)]
        # A second Ctrl-C (or a signal handler's exception) can land anywhere in here: every
        # member still gets its SIGKILL and is reaped, and the interrupt is raised afterwards.
        interrupt: BaseException | None = None
        for wait in (False, True):
            for p in procs:
                for _ in range(3):
                    try:
                        if wait:
                            p.wait()
                        elif p.poll() is None:
                            p.kill()
                        break
                    except BaseException as exc:  # noqa: BLE001 -- re-raised below
                        interrupt = interrupt or exc
        for ps in self.proxies.values():
            for p in ps:
                p.close()
        if interrupt is not None:
            raise interrupt

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def _signals_deferred(signums=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Hold Ctrl-C, SIGTERM and SIGHUP while the block runs; then act on the first one caught
    as its handler would have (the handler in place before the block runs once, afterwards).

    A no-op outside the main thread, where Python never runs signal handlers. A signal whose
    handler was not set from Python (``getsignal`` gives None) is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old: dict[int, object] = {}
    try:
        for s in signums:
            if signal.getsignal(s) is not None:
                old[s] = signal.signal(s, lambda signum, _frame: caught.append(signum))
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if caught:
            handler = old[caught[0]]
            if callable(handler):
                handler(caught[0], None)  # e.g. default_int_handler raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


def run_keys(folder: Path):
    """(folder, TlsConfig) of the run's keys in ``folder``: made there unless already complete."""
    from shoal.net.tls import CA_FILE, CERT_FILE, KEY_FILE, load_tls, make_keys

    if not all((folder / f).is_file() for f in (CA_FILE, CERT_FILE, KEY_FILE)):
        make_keys(folder)
    return folder, load_tls(str(folder))


STATUS_TIMEOUT_S = 30.0  # a loaded coordinator (a busy 2-core box) may take seconds to finish a TLS handshake


def swarm_status(address: str, token: str, timeout_s: float = STATUS_TIMEOUT_S, tls=None) -> dict:
    """The coordinator's status (ready, committed steps, epoch, servers, workers by stage).

    ``timeout_s`` covers the connection and its TLS handshake too: with a deadline of a few
    seconds a loaded coordinator's handshake was cut off ("handshaker shutdown") although the
    coordinator was fine. A coordinator that is not there still fails at once (connection
    refused)."""
    import asyncio

    import grpc

    from shoal.net import shoal_pb2 as pb
    from shoal.net import shoal_pb2_grpc as pbg
    from shoal.net.channel import open_channel

    async def ask() -> dict:
        async with open_channel(address, token, tls=tls) as ch:
            rep = await pbg.CoordinatorStub(ch).Status(pb.Empty(), timeout=timeout_s)
        return json.loads(rep.json)

    try:
        return asyncio.run(ask())
    except grpc.aio.AioRpcError as exc:
        raise ShoalError(f"no status from the coordinator at {address}: {exc.details()}") from None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: LaunchConfig, on_event: Callable[[dict], None] | None = None,
           on_start: Callable[[Swarm], None] | None = None) -> dict:
    """Run a local swarm to completion and return the run summary.

    ``on_start(swarm)`` runs once every process is started (e.g. to print the coordinator's
    address and the dashboard URL).
    """
    with Swarm(cfg, on_event) as swarm:
        swarm.start()
        if on_start is not None:
            on_start(swarm)
        return swarm.wait()


def should_restart(rc: int, restarts_left: int, run_done: bool) -> bool:
    """Whether ``launch`` restarts a coordinator that exited with ``rc`` (pure).

    0 ends the run (done), 2 too (a one-line error: a failed run, bad input). Any other
    status is a death, restarted with ``--resume`` while restarts are left, unless the run's
    journal already says "done": a coordinator that died after finishing (a crash in
    interpreter teardown, a stray signal) would come back to nothing to resume.
    """
    return rc not in (0, 2) and restarts_left > 0 and not run_done


class Stopped(ShoalError):
    """``shoal launch`` got SIGTERM or SIGHUP (its members were stopped)."""


def stop_on_signals() -> None:
    """SIGTERM/SIGHUP end ``launch`` like Ctrl-C (SIGINT): the swarm's ``__exit__`` kills every member.

    Members run in their own sessions (a terminal's signals do not reach them), so the
    launcher must stop them itself. Call from the main thread only.
    """
    def handler(signum, frame):
        raise Stopped(f"stopped by {signal.Signals(signum).name}; every member was stopped")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    # Ctrl-C too, even when the launcher was started with SIGINT ignored (a shell's
    # background job inherits that): it raises KeyboardInterrupt, which stops the swarm.
    signal.signal(signal.SIGINT, signal.default_int_handler)
