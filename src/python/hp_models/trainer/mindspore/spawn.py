"""Running the MindSpore ranks the way ``msrun`` does: a scheduler process (``MS_ROLE=MS_SCHED``)
on a port the OS hands out, and one worker per rank with ``MS_ROLE=MS_WORKER``,
``MS_SCHED_HOST``, ``MS_SCHED_PORT``, ``MS_WORKER_NUM`` and ``MS_NODE_ID``; the workers join
mccl at the scheduler.  ``hp_models.launch`` supervises the workers (a rank that dies stops the
job and is named; the ranks die with the launcher), the scheduler is stopped with them.  On
Linux both fork from the launcher's fork server, which imports MindSpore once for all of them.
Under ``msrun`` itself the command is the scheduler or one worker (``run_launched``).

Before the ranks start, a torch process writes the torch trainer's initial weights for the seed
(``weights.initial_state_file``) to the launcher's temporary folder.  No MindSpore is imported
by the launcher itself.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import traceback
from typing import Any

from hp_models.job import TrainLayout
from hp_models.launch import die_with_parent, launch, start_beside
from hp_models.trainer.args import Args
from hp_models.trainer.mindspore.weights import initial_state_file
from hp_models.trainer.spawn import user_error

_PLATFORM = {"HYPER_PARALLEL_PLATFORM": "mindspore"}
# What the scheduler and every worker import first, imported once by the launcher's fork server:
# MindSpore's DTensor backend, and torch (the model's config package imports the torch model).
# Neither selects the platform when imported, so each rank still selects MindSpore itself.
RANK_MODULES = ("hp_dtensor.platform.mindspore", "torch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scheduler(env: dict[str, str], launcher_pid: int) -> None:
    os.environ.update(env)
    die_with_parent(launcher_pid)
    from hp_dtensor.platform import current

    current().serve_scheduler()


def _worker(rank: int, world: int, args: Args, layout: TrainLayout, weights: str, quiet: bool,
            env: dict[str, str], store: str, results: Any, launcher_pid: int) -> None:
    os.environ.update(env)
    if world > 1:
        os.environ.update({"MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank)})
    try:
        die_with_parent(launcher_pid)
        from hp_dtensor.platform import current
        from hp_models.trainer.checks import load_config
        from hp_models.trainer.mindspore.loop import train_ms

        plat = current()
        if plat.NAME != "mindspore":  # the fork server had selected another platform for good
            raise RuntimeError(f"a MindSpore rank forked with the {plat.NAME} backend already selected; launch the "
                               f"MindSpore trainer from a process that has not run the {plat.NAME} trainer")
        plat.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # synchronous ops (see its docstring)
        plat.init_rank(None, store, rank, world, timeout_s=600)
        out = train_ms(args, layout, load_config(args), rank, weights, distributed=world > 1, quiet=quiet)
        plat.destroy()
        results.put((rank, True, out if rank == 0 else None))
    except BaseException as e:
        line = user_error(e)
        results.put((rank, False, ("user", line) if line is not None else ("traceback", traceback.format_exc())))


def run_spawned_ms(args: Args, layout: TrainLayout, config: Any, *, quiet: bool = False) -> dict[str, Any]:
    """Start the scheduler and ``layout.world_size`` workers (one process and no scheduler for a
    world of one), wait for them and return rank 0's result."""
    folder = tempfile.mkdtemp(prefix="hp-train-ms-")
    scheduler = None
    world = layout.world_size
    env = dict(_PLATFORM)
    try:
        weights = initial_state_file(config, args.seed, folder)
        if world > 1:
            env.update({"MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(_free_port()),
                        "MS_WORKER_NUM": str(world), "GLOG_v": os.environ.get("GLOG_v", "3")})
            scheduler = start_beside(_scheduler, ({**env, "MS_ROLE": "MS_SCHED"}, os.getpid()), preload=RANK_MODULES)
        out: dict[str, Any] = launch(world, _worker, (args, layout, weights, quiet, env), preload=RANK_MODULES)
        return out
    finally:
        if scheduler is not None:
            # Every worker has left (or was stopped): the scheduler would linger on its heartbeat.
            scheduler.terminate()
            scheduler.join(timeout=10)
            if scheduler.is_alive():
                scheduler.kill()
                scheduler.join(timeout=5)
        shutil.rmtree(folder, ignore_errors=True)


def serve_scheduler() -> None:
    """Under ``msrun``, the scheduler's role (``MS_ROLE=MS_SCHED``)."""
    from hp_dtensor.platform import current

    current().serve_scheduler()


def run_launched(args: Args, layout: TrainLayout, config: Any) -> tuple[int, dict[str, Any]]:
    """Under ``msrun`` (``MS_ROLE=MS_WORKER``): join the job, train, and return this rank and its
    result.  Each worker has a torch process write the initial weights to a folder of its own."""
    from hp_dtensor.platform import current
    from hp_models.trainer.mindspore.loop import train_ms

    plat = current()
    world = layout.world_size
    plat.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    folder = tempfile.mkdtemp(prefix="hp-train-ms-")
    try:
        weights = initial_state_file(config, args.seed, folder)
        plat.ensure_process_group("cpu")
        rank = plat.get_rank()
        result = train_ms(args, layout, config, rank, weights, distributed=world > 1)
        plat.destroy()
        return rank, result
    finally:
        shutil.rmtree(folder, ignore_errors=True)
