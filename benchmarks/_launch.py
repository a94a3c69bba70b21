"""The benchmarks' launcher: run a job on fresh processes, bounded in time, and collect each
rank's value.

``launch(fn, job, world, timeout)`` starts ``world`` processes. Each rank pins gloo and OpenMP
(one thread: the ranks share the machine's cores), sets the environment torchrun would set (what
Accelerate reads), initialises the default gloo process group on 127.0.0.1 when ``world > 1``,
runs ``fn(rank, world, job)`` and sends back ``("ok", value)`` or the error with its traceback.
The parent waits at most ``timeout`` seconds, kills what is left, and raises if a rank did not
report or raised.

Used by suite.py, sharded.py, compression.py and scale.py; loop_probes.py starts its probes its
own way (each rank lingers until every rank has reported, and a probe may exit on purpose) and
shares only ``free_port``. tests/dist.py is the tests' own launcher (the tests do not import the
benchmarks), and each example under examples/ stays one file that runs alone.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable[[int, int, dict[str, Any]], Any],
    job: dict[str, Any],
    out: Any,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["OMP_NUM_THREADS"] = "1"  # else Accelerate sets its own thread count
    torch.set_num_threads(1)
    if world > 1:
        # What torchrun sets and Accelerate reads; it finds the process group below initialised.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=job["pg_timeout"]),
        )
    try:
        result: tuple[Any, ...] = ("ok", fn(rank, world, job))
    except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
        result = ("err", f"{type(err).__name__}: {err}", traceback.format_exc())
    out.put((rank, result))
    out.close()
    out.join_thread()  # flushed before teardown, which gloo rarely aborts at interpreter exit
    if world > 1:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch(
    fn: Callable[[int, int, dict[str, Any]], Any],
    job: dict[str, Any],
    world: int,
    timeout: float,
    *,
    what: str = "job",
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world, job)`` on ``world`` fresh processes; return each rank's value.

    ``fn`` is a module-level function (the processes import it); ``job["pg_timeout"]`` bounds
    each collective when ``world > 1``. ``what`` names the job in the errors raised when a rank
    did not report (hung, died or timed out) or raised.
    """
    ctx = mp.get_context(start_method)
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, job, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[Any, ...]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, result = out.get(timeout=0.5)
                results[rank] = result
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    for r in range(world):
        if r not in results:
            raise RuntimeError(f"{what}: rank {r} did not report (hung, died or timed out)")
        if results[r][0] != "ok":
            raise RuntimeError(f"{what}: rank {r} raised {results[r][1]}\n{results[r][2]}")
    return [results[r][1] for r in range(world)]
