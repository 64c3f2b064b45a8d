"""Starting tensor-parallel ranks, one process each: under torchrun (which sets RANK, WORLD_SIZE and
LOCAL_RANK) or spawned here. Each rank joins the default process group (NCCL on CUDA, on device
cuda:LOCAL_RANK; gloo on the CPU) and runs the same function, which gets its device."""
import ctypes
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RankMain = Callable[[str], int]  # the rank's device -> exit code; must pickle (a module-level function or partial)
SHUTDOWN_GRACE_S = 15.0  # how long the other ranks get to finish after rank 0 ends
PR_SET_PDEATHSIG = 1
EXPECTED_ERRORS = (ValueError, OSError, KeyboardInterrupt)  # reported in one line, as the command line does


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_tensor_parallel(main: RankMain, tp: int, device: str) -> int:
    """main(device) on every rank of a tensor-parallel group of `tp` ranks; returns rank 0's exit code, or the
    exit code of a rank that failed first. An exception in a spawned rank is raised here (rank 0's first)."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if tp not in (1, world):
            raise ValueError(f"--tp {tp} does not match the {world} processes torchrun started")
        return run_rank(main, device)
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if tp == 1:
        return main(device)
    if device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise ValueError(f"--tp {tp} needs {tp} GPUs; this host has {torch.cuda.device_count()}")
    return spawn(main, tp, device)


def run_rank(main: RankMain, device: str) -> int:
    """Join the process group described by the environment, run main on this rank's device, leave the group."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if device.startswith("cuda"):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        # device_id: the communicator is set up now, not lazily inside the first captured CUDA graph
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:  # (each command's main sizes its CPU threads: flashdraft.args.set_threads)
        dist.init_process_group("gloo")
    try:
        return main(device)
    finally:
        dist.destroy_process_group()


def spawn(main: RankMain, world: int, device: str) -> int:
    """Start `world` rank processes on this host and wait for them. SIGINT and SIGTERM sent here go to rank 0,
    which is the one to wind the others down (a server tells its followers to stop)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_process, args=(main, device, rank, world, port, errors), name=f"rank-{rank}")
             for rank in range(world)]
    for p in procs:
        p.start()
    def to_rank0(*_) -> None:
        if procs[0].exitcode is None:
            os.kill(procs[0].pid, signal.SIGINT)

    forwarding = threading.current_thread() is threading.main_thread()
    if forwarding:
        previous = {sig: signal.signal(sig, to_rank0) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _supervise(procs)
    finally:
        if forwarding:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    expected = [e for _, e in sorted(failures, key=lambda f: f[0]) if isinstance(e, EXPECTED_ERRORS)]
    if expected:  # the others printed their traceback in their rank
        raise expected[0]
    return code


def _supervise(procs: list) -> int:
    """Wait until rank 0 ends or a rank fails; end the others (after a grace period if nothing failed)."""
    running = {p.sentinel: p for p in procs}
    first_failure = None
    while procs[0].exitcode is None and first_failure is None:
        for sentinel in wait(list(running)):
            ended = running.pop(sentinel)
            ended.join()
            if ended.exitcode != 0 and first_failure is None:
                first_failure = ended
    for p in procs:
        p.join(SHUTDOWN_GRACE_S if first_failure is None else 0)  # after a failure the rest cannot go on
        if p.is_alive():
            p.terminate()
            p.join()
    code = (first_failure or procs[0]).exitcode
    return code if code >= 0 else 128 - code


def _rank_process(main: RankMain, device: str, rank: int, world: int, port: int, errors) -> None:
    os.setpgrp()  # a Ctrl-C in the terminal reaches the launcher only, which passes it to rank 0
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # do not outlive a killed launcher
    except (OSError, AttributeError):
        pass
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        code = run_rank(main, device)
    except BaseException as e:
        if not isinstance(e, EXPECTED_ERRORS):
            traceback.print_exc()
        try:
            errors.put((rank, e))
        except Exception:  # an exception that does not pickle
            errors.put((rank, RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: with the group destroyed and everything reported, what is left is the
    # destruction of gloo's C++ objects at exit, which now and then aborts ("terminate called without an active
    # exception") and would turn a finished rank's exit code into 134. Forked multiprocessing children end so too.
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
