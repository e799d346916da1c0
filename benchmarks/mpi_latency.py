"""Where a small message's time goes over MPI: raw mpi4py against ringpipe's layers, same run.

2 ranks exchange 4 KiB both ways (``irecv`` + ``isend`` + both waits) for several rounds:
raw mpi4py, ringpipe's communicator (argument checks, the event record, the handle) with
Python's garbage collector on and off, then a 4 KiB allreduce: ringpipe's checked recursive
doubling, the same with ``check=False``, the communicator's native ``MPI_Allreduce`` and raw
mpi4py ``Allreduce``. Every round runs every case once (the order rotated from round to round,
so drift of a shared machine falls on all of them); rank 0 prints, per case, the median over
rounds of the mean time per call and the range.

    python benchmarks/mpi_latency.py            # starts 2 ranks under mpirun
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

ROUNDS, CALLS = 6, 3000


def worker() -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    from ringpipe import collectives
    from ringpipe.comm import init_world

    torch.set_num_threads(1)
    comm = init_world("mpi")
    world = MPI.COMM_WORLD
    peer = 1 - comm.rank
    a, b = np.ones(1024, dtype=np.float32), np.empty(1024, dtype=np.float32)
    ta, tb, x = torch.ones(1024), torch.empty(1024), torch.ones(1024)

    def raw_exchange() -> None:
        r, s = world.Irecv(b, peer, 1), world.Isend(a, peer, 1)
        r.Wait()
        s.Wait()

    def ringpipe_exchange() -> None:
        r, s = comm.irecv(tb, peer, 1), comm.isend(ta, peer, 1)
        r.wait()
        s.wait()

    cases = [
        ("mpi4py irecv+isend+waits", raw_exchange, True),
        ("ringpipe irecv+isend+waits", ringpipe_exchange, True),
        ("ringpipe irecv+isend+waits, gc off", ringpipe_exchange, False),
        ("ringpipe allreduce (rd, checked)", lambda: collectives.allreduce(comm, x, algorithm="recursive_doubling"), True),
        ("ringpipe allreduce (rd, check=False)",
         lambda: collectives.allreduce(comm, x, algorithm="recursive_doubling", check=False), True),
        ("communicator allreduce (MPI_Allreduce)", lambda: comm.allreduce(x), True),
        ("mpi4py Allreduce", lambda: world.Allreduce(MPI.IN_PLACE, a, MPI.SUM), True),
    ]
    rounds: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for r in range(ROUNDS):
        k = r % len(cases)
        for name, fn, collect in cases[k:] + cases[:k]:  # every case once per round, the order rotated
            (gc.enable if collect else gc.disable)()
            world.Barrier()
            t = time.perf_counter()
            for _ in range(CALLS):
                fn()
            rounds[name].append((time.perf_counter() - t) / CALLS * 1e6)
        gc.enable()
    if comm.rank == 0:
        print(f"{'':40s} {'median':>7}  {'min-max':>15}  us per call over {ROUNDS} rounds", flush=True)
        for name, us in rounds.items():
            print(f"{name:40s} {statistics.median(us):7.2f}  {min(us):7.2f}-{max(us):<7.2f}", flush=True)


def main() -> int:
    if "--worker" in sys.argv:
        worker()
        return 0
    from ringpipe.launch import mpirun_command

    env = dict(os.environ, OMP_NUM_THREADS="1", RINGPIPE_STALL_CHECK_SECONDS="0")
    print(f"2 ranks under mpirun, 4 KiB, {ROUNDS} rounds of {CALLS} calls each", flush=True)
    import subprocess

    return subprocess.run(mpirun_command(2, [sys.executable, __file__, "--worker"]), env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
