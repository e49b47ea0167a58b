"""One run per run directory: a lock against a second writer, and what to do with a previous run.

Lock. `<run_dir>/.lock` holds the host, pid and start time of the process that trains there
(process 0 of a job). A second run in the same folder stops at once with one line naming the
holder. A lock left by a process that no longer exists on this host (killed with -9, or a
crashed machine's pid now unused) is taken over with a note. A lock from another host cannot
be checked from here; the message says how to remove it.

Previous run. `train.resume` decides what happens to checkpoints and metrics already in the
folder: `auto` continues from the newest checkpoint (metrics rows after it, from steps that
will run again, are dropped, so each step keeps one row); `never` refuses a folder that holds a
previous run; `archive` moves it to `<run_dir>/archive/<time>/`; `overwrite` deletes it. A run
never appends to another run's metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

from jaxtron.errors import JaxtronError

LOCK = ".lock"
# What a run writes into its folder (config.yaml is rewritten by every run).
RUN_FILES = ("checkpoints", "metrics.jsonl", "loss.png", "tensorboard", "profile")


class RunDirError(JaxtronError):
    """A run directory that is in use, unwritable, or holds a run this one must not mix with."""


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux), so a reused pid is not taken for the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return started is None or _process_start(pid) in (None, started)


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def cannot_write(folder: Path) -> str | None:
    """Create `folder` and write a file in it; the OS's reason if that fails, else None."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def _writable(run_dir: Path) -> None:
    why = cannot_write(run_dir)
    if why:
        raise RunDirError(f"train.run_dir={run_dir} cannot be written ({why}); choose a "
                          "folder you can write to, or fix its permissions.")


@contextlib.contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Hold `<run_dir>/.lock` for the duration; see the module docstring."""
    _writable(run_dir)
    path = run_dir / LOCK
    me = _holder()
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}
            stale = (holder.get("host") == me["host"] and isinstance(holder.get("pid"), int)
                     and not _alive(holder["pid"], holder.get("process_start")))
            if not stale:
                who = (f"pid {holder.get('pid')} on host {holder.get('host')} since "
                       f"{holder.get('since')}" if holder else "an unreadable lock")
                raise RunDirError(
                    f"train.run_dir={run_dir} is in use by another run ({who}); wait for it to "
                    f"finish, choose another train.run_dir, or, if that process is gone, delete "
                    f"{path}.") from None
            # Renaming is atomic: of two runs that find the same stale lock, one moves it.
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, run_dir / f"{LOCK}.stale-{os.getpid()}")
                print(f"note: taking over {path} from pid {holder['pid']} on "
                      f"{holder['host']}, which no longer runs", flush=True)
                (run_dir / f"{LOCK}.stale-{os.getpid()}").unlink()
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        break
    else:
        raise RunDirError(f"train.run_dir={run_dir}: could not take {path} (other runs keep "
                          "replacing it); start one run at a time in this folder.")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == me["pid"]:
                path.unlink()


def previous_run(run_dir: Path, latest_checkpoint: int | None) -> str | None:
    """A description of what a previous run left in `run_dir`, or None if it holds none."""
    parts = []
    if latest_checkpoint is not None:
        parts.append(f"checkpoints up to step {latest_checkpoint}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        parts.append("metrics.jsonl")
    return " and ".join(parts) or None


def clear_previous_run(run_dir: Path, mode: str, found: str) -> None:
    """Apply train.resume=never/archive/overwrite to a folder holding a previous run."""
    if mode == "never":
        raise RunDirError(
            f"train.run_dir={run_dir} holds a previous run ({found}) and train.resume=never; "
            "set train.resume=auto to continue it, train.resume=archive to move it to "
            f"{run_dir}/archive/ and start afresh, train.resume=overwrite to delete it, or "
            "choose another train.run_dir.")
    present = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if mode == "archive":
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target, n = run_dir / "archive" / stamp, 1
        while target.exists():
            target, n = run_dir / "archive" / f"{stamp}-{n}", n + 1
        target.mkdir(parents=True)
        for path in present:
            shutil.move(str(path), target / path.name)
        print(f"note: moved the previous run ({found}) to {target}", flush=True)
        return
    for path in present:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    print(f"note: deleted the previous run ({found}) in {run_dir} (train.resume=overwrite)",
          flush=True)


def metric_row(line: str) -> dict | None:
    """One metrics.jsonl row, or None for a row cut short by a kill (its step runs again)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def metric_rows(run_dir: Path) -> list[dict]:
    """The complete rows of `<run_dir>/metrics.jsonl`, in order."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [row for row in map(metric_row, path.read_text().splitlines()) if row]


def last_logged_step(run_dir: Path, tail_bytes: int = 65536) -> int:
    """The newest step in `<run_dir>/metrics.jsonl` (0 when none), from the file's end only:
    rows are in step order (a resumed run drops the rows it logs again), and a watcher polls
    this while the file grows."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - tail_bytes, 0))
        lines = f.read().decode(errors="replace").splitlines()
    rows = [row for row in map(metric_row, reversed(lines)) if row]
    return rows[0]["step"] if rows else 0


def keep_metrics_through(run_dir: Path, step: int) -> None:
    """Drop metrics rows after `step`: a resumed run logs those steps again."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        row = metric_row(line)
        if row is not None and row["step"] <= step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
