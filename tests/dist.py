"""Run a function on 2 gloo processes on 127.0.0.1, bounded in time, and collect what each rank
returned or raised.

Each rank: pins gloo to the loopback interface, initialises the default process group over a
TCP store on 127.0.0.1 (a free port), runs ``fn(rank, world, *args)``, sends back
``("ok", value)`` or ``("err", type_name, message)``, destroys the process group and exits with
``os._exit(0)`` (no interpreter finalization, which a gloo worker thread still finishing an
abandoned collective would abort). The parent waits at most ``timeout`` seconds, then kills what
is left.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
    pg_timeout: float,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        result: tuple[Any, ...] = ("ok", fn(rank, world, *args))
    except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
        result = ("err", type(err).__name__, str(err), traceback.format_exc())
    # As bytes: tensors sent through the queue itself are shared by file descriptor, which the
    # parent can no longer fetch once this process has exited.
    buf = io.BytesIO()
    try:
        torch.save(result, buf)
    except Exception as err:  # noqa: BLE001 - an unpicklable result is reported, not lost
        buf = io.BytesIO()
        torch.save(("err", type(err).__name__, f"unpicklable result: {err}", ""), buf)
    out.put((rank, buf.getvalue()))
    out.close()
    out.join_thread()  # the result is with the parent before any teardown
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001, S110 - a broken group (killed peer) may refuse
        pass
    # No interpreter finalization: after a failed or timed-out collective, whatever still refers
    # to the group (a traceback, an object of fn's) keeps its gloo backend alive past
    # destroy_process_group(), and a gloo worker thread may still hold the abandoned collective.
    # When that ends (the peer exits or times out) the thread drops the work's tensors, which
    # takes the GIL; during finalization CPython ends the thread there with pthread_exit(), inside
    # a C++ destructor, and the process aborts: "terminate called without an active exception".
    # The result is already with the parent, which reads only the queue.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load(payload: bytes) -> tuple[Any, ...]:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)  # type: ignore[no-any-return]


def run(
    fn: Callable[..., Any],
    *args: Any,
    world: int = WORLD,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
) -> dict[int, tuple[Any, ...]]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return ``{rank: result}``.

    A rank that exits without reporting (killed on purpose) is missing from the result.
    ``fn`` must be importable (a module-level function of a test module).
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, fn, args, out, pg_timeout), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[Any, ...]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, payload = out.get(timeout=min(left, 0.5))
                results[rank] = _load(payload)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def values(results: dict[int, tuple[Any, ...]], world: int = WORLD) -> list[Any]:
    """The value of every rank, failing the test with the rank's traceback if one raised."""
    missing = [r for r in range(world) if r not in results]
    assert not missing, f"ranks {missing} did not report (hung or died); got {results}"
    for r in range(world):
        assert results[r][0] == "ok", f"rank {r} raised:\n{results[r][3]}"
    return [results[r][1] for r in range(world)]


def launch(
    script: str, *args: str, env: dict[str, str] | None = None, deadline: float = 120.0
) -> list[tuple[int | None, str, str]]:
    """Run ``python script *args`` as 2 ranks, as torchrun would (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), each interpreter exiting by itself; each
    rank's ``(exit code, stdout, stderr)``. Bounded: what still runs at ``deadline`` seconds
    after the launch is killed (its stderr then ends with a ``HUNG`` line)."""
    import subprocess
    import time
    from pathlib import Path

    port = free_port()
    root = str(Path(__file__).resolve().parents[1])
    procs = []
    for r in range(WORLD):
        rank_env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "error",
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    end = time.monotonic() + deadline
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += f"\nHUNG: still running {deadline:g} s after the launch (killed)"
        out.append((p.returncode, stdout, stderr))
    return out


def torchrun(
    script: str, *args: str, env: dict[str, str] | None = None, deadline: float = 120.0
) -> tuple[int | None, str]:
    """Run ``torchrun --standalone --nproc-per-node 2 script *args`` (a free port on
    127.0.0.1); its exit code (non-zero when a rank failed) and its output, both ranks' lines
    and torchrun's own. Bounded: what still runs at ``deadline`` seconds is killed."""
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={WORLD}", script, *args]
    run_env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    try:
        done = subprocess.run(
            cmd, env=run_env, capture_output=True, text=True, timeout=deadline, check=False
        )
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        return None, out + f"\nHUNG: still running {deadline:g} s after the launch (killed)"
    return done.returncode, done.stdout + done.stderr


def exited(ranks: list[tuple[int | None, str, str]]) -> tuple[list[str], list[str | None]]:
    """What went wrong with each rank's exit (a code other than 0, a signal, "terminate called",
    not exactly one ``RESULT`` line), and each rank's ``RESULT`` line (``None``: not one)."""
    import signal

    problems: list[str] = []
    lines: list[str | None] = []
    for r, (code, stdout, stderr) in enumerate(ranks):
        tail = "\n".join(stderr.splitlines()[-15:])
        if code != 0:
            name = signal.Signals(-code).name if code is not None and code < 0 else code
            problems.append(f"rank {r} exited with {code} ({name}); stderr:\n{tail}")
        if "terminate called" in stderr:
            problems.append(f"rank {r}: {tail}")
        results = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if len(results) != 1:
            problems.append(f"rank {r} printed no result; stdout:\n{stdout}\nstderr:\n{tail}")
        lines.append(results[0] if len(results) == 1 else None)
    return problems, lines
