"""One screen reference gradient per host, layer range and round, shared by the stage servers there.

In local mode every stage server computes a reference gradient each round (its screen judges
each pseudo-gradient by its cosine to it; ``docs/poisoning-local.md``), and for a whole-model
stage that is the largest CPU cost of a round. Stage servers of pipeline replicas that hold the
same layers start each round from the same merged weights (a replica merge gives every
replica's stage the same bits), so their references would be gradients of the same function:
one of them computes it and the others on that host read it. The planner prices it so
(``shoal.plan.cost.reference_groups``).

The servers meet in a folder they share (``<ckpt-dir>/run-<id>/reference``: the servers of a
run on one host that share a ``--ckpt-dir``, as ``shoal launch`` starts them). A round's file is
named by the run's epoch, the merged version, the layer range and the merged weights' digest,
so only servers holding the very same weights share it:

1. a server that finds ``STEM.safetensors`` reads it (safetensors: no pickle);
2. else it tries to claim the round (``STEM.claim``, holding its pid and host name, made by a
   hard link that fails if a peer's is there):
   the claimer computes, writes ``STEM.safetensors`` through a temporary name and a rename,
   and removes its claim;
3. else it waits for the file while the claimer's process lives; a claim whose process is
   gone (killed) or that is taken back without a file (the claimer's epoch moved on) is
   claimed again, so a dead claimer costs a wait, never a round. A claim of another host (a
   folder on the network) is waited on for at most ``FOREIGN_WAIT_S``.

A file that does not match the stage (names, shapes) is not used: the server computes its own.
The writer of a round removes the files of earlier rounds of its layer range (a dead peer's
too, :func:`superseded`), and each server removes what it wrote when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from shoal.runtime.common import pid_alive

log = logging.getLogger("shoal.refshare")

POLL_S = 0.05  # how often a waiting server looks for the claimer's file
# Longest a server waits on a claim made on another host (a --ckpt-dir on a network folder),
# whose process it cannot see: then it computes its own.
FOREIGN_WAIT_S = 600.0


STEM_RE = re.compile(r"^ref-e(\d+)-v(\d+)-l(\d+)-(\d+)-[0-9a-f]+\.safetensors$")


def reference_stem(epoch: int, version: int, first: int, last: int, digest: str) -> str:
    """The file stem of one round's reference (pure): epoch, merged version, layers [first, last)
    and the first 16 hex digits of the merged weights' digest."""
    return f"ref-e{epoch}-v{version}-l{first}-{last}-{digest[:16]}"


def superseded(names: list[str], stem: str) -> list[str]:
    """The reference files among ``names`` that the round of ``stem`` supersedes (pure): those
    of the same layer range from an earlier (epoch, version). Every server of that range has
    moved past them (one still reading keeps its open file; one that has not opened it yet
    computes its own), so the writer of a newer round removes them, a dead peer's included."""
    m = STEM_RE.match(stem + ".safetensors")
    if m is None:
        return []
    at, layers = (int(m[1]), int(m[2])), (m[3], m[4])
    out = []
    for name in names:
        o = STEM_RE.match(name)
        if o is not None and (o[3], o[4]) == layers and (int(o[1]), int(o[2])) < at:
            out.append(name)
    return out


def claim_state(path: Path) -> tuple[bool, bool]:
    """``(alive, here)`` of the claim at ``path``: whether it may still be worked on, and whether
    it names a process of this host (whose life can be checked). A claim being written counts
    as alive; one of another host (a folder shared over the network) as alive, not here."""
    try:
        pid_text, _, host = path.read_text().strip().partition(" ")
        pid = int(pid_text)
    except FileNotFoundError:
        return False, True
    except (OSError, ValueError):
        return path.exists(), True  # (not a claim this code wrote: alive while it is there)
    if host and host != socket.gethostname():
        return True, False
    return pid > 0 and pid_alive(pid), True


def claim_alive(path: Path) -> bool:
    """Whether the claim at ``path`` exists and may still be worked on (:func:`claim_state`)."""
    return claim_state(path)[0]


class ReferenceShare:
    """One stage server's end of the shared references in ``folder``."""

    def __init__(self, folder: str | Path, foreign_wait_s: float = FOREIGN_WAIT_S):
        self.folder = Path(folder)
        self.foreign_wait_s = foreign_wait_s  # longest wait on a claim of another host
        self.written: list[Path] = []  # the file this server wrote last (removed at close)

    def _claim(self, stem: str) -> bool:
        """Claim the round: its claim file appears whole or not at all (written apart, then
        hard-linked to its name, which fails if a peer's is there), so no peer reads it empty."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{stem}.{os.getpid()}.claim"
        tmp.write_text(f"{os.getpid()} {socket.gethostname()}")
        try:
            os.link(tmp, self.folder / f"{stem}.claim")
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return True

    def _write(self, stem: str, ref: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"{stem}.safetensors"
        tmp = self.folder / f".{stem}.{os.getpid()}.tmp"
        save_file({n: t.detach().contiguous() for n, t in ref.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
        for name in superseded(os.listdir(self.folder), stem):
            with contextlib.suppress(OSError):
                (self.folder / name).unlink()
        self.written = [path]

    @staticmethod
    def _read(path: Path, like: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if sorted(f.keys()) != sorted(like):
                    return None
                out = {n: f.get_tensor(n) for n in like}
        except (OSError, SafetensorError) as exc:
            log.warning("shared reference %s could not be read (%s); computing this server's own", path, exc)
            return None
        if any(out[n].shape != like[n].shape or out[n].dtype != like[n].dtype for n in like):
            return None
        return out, meta

    async def get(self, stem: str, like: dict[str, torch.Tensor],
                  compute: Callable[[], Awaitable[tuple[dict[str, torch.Tensor], dict[str, str]]]]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
        """The round's reference: ``(tensors, metadata, how)``, ``how`` "computed" (here, and
        shared), "shared" (read from a peer's file) or "own" (computed here, not shared: the
        folder could not be used). ``like``: the stage's parameters (names, shapes, dtypes a
        shared file must match). ``compute``: computes it, returning (tensors, metadata)."""
        loop = asyncio.get_running_loop()
        path = self.folder / f"{stem}.safetensors"
        claim = self.folder / f"{stem}.claim"
        while True:
            if path.exists():
                got = await loop.run_in_executor(None, self._read, path, like)
                if got is not None:
                    return got[0], got[1], "shared"
                return (*await compute(), "own")
            try:
                mine = self._claim(stem)
            except OSError as exc:
                log.warning("reference folder %s is not usable (%s); computing this server's own", self.folder, exc)
                return (*await compute(), "own")
            if mine:
                try:
                    ref, meta = await compute()
                    try:
                        await loop.run_in_executor(None, self._write, stem, ref, meta)
                    except OSError as exc:
                        log.warning("shared reference %s not written (%s)", path, exc)
                    return ref, meta, "computed"
                finally:
                    with contextlib.suppress(OSError):
                        claim.unlink()
            # claimed by a peer: wait for its file while it lives
            since = time.monotonic()
            while not path.exists():
                alive, here = claim_state(claim)
                if not alive:
                    break
                if not here and time.monotonic() - since > self.foreign_wait_s:
                    log.warning("reference %s claimed by another host for %.0f s; computing this server's own",
                                stem, self.foreign_wait_s)
                    return (*await compute(), "own")
                await asyncio.sleep(POLL_S)
            if not path.exists():
                with contextlib.suppress(OSError):
                    if not claim_alive(claim):
                        claim.unlink()  # its process is gone: claim the round again

    def close(self) -> None:
        """Remove the files this server wrote."""
        for p in self.written:
            with contextlib.suppress(OSError):
                p.unlink()
        self.written = []
