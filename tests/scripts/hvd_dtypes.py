"""Every dtype through the Horovod-style collectives, on the global set and a process set (run in each rank).

Imported by the tests under ``ringpipe.launch.spawn`` and run as a script under ``mpirun``;
returns the names of the checks that failed (an empty list when all hold).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import ringpipe as hvd

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]


def _value(r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(n) % 3 + r  # small: no overflow in any dtype
    return (base % 2).to(dtype) if dtype == torch.bool else base.to(dtype)


def check(comm) -> list[str]:  # noqa: ANN001
    hvd.init(comm, process_sets="dynamic")
    bad: list[str] = []
    try:
        size, r = hvd.size(), hvd.rank()
        pair = hvd.add_process_set([0, size - 1] if size > 2 else [size - 1])  # [0, 1] would be the global set
        for ps in (hvd.global_process_set, pair):
            if not ps.included():
                continue
            members = ps.ranks
            for dtype in DTYPES:
                tag = f"{dtype} set{ps.process_set_id}"
                x = _value(r, 6, dtype)
                if dtype != torch.bool:
                    want = sum(_value(m, 6, torch.int64) for m in members)
                    got = hvd.allreduce(x, op=hvd.Sum, process_set=ps)
                    if got.dtype != dtype or not torch.equal(got.to(torch.int64), want):
                        bad.append(f"allreduce {tag}")
                    rows = [_value(m, 2 * (m + 1), dtype).reshape(-1, 2) for m in members]
                    got = hvd.reducescatter(torch.cat([_value(r, 2 * len(members), dtype)]), op=hvd.Sum,
                                            process_set=ps)
                    full = sum(_value(m, 2 * len(members), torch.int64) for m in members)
                    me = members.index(r)
                    if not torch.equal(got.to(torch.int64), full[2 * me:2 * me + 2]):
                        bad.append(f"reducescatter {tag}")
                rows = [_value(m, 2 * (m + 1), dtype).reshape(-1, 2) for m in members]
                got = hvd.allgather(_value(r, 2 * (r + 1), dtype).reshape(-1, 2), process_set=ps)
                if got.dtype != dtype or not torch.equal(got, torch.cat(rows)):
                    bad.append(f"allgather {tag}")
                got = hvd.broadcast(x, root_rank=members[-1], process_set=ps)
                if not torch.equal(got, _value(members[-1], 6, dtype)):
                    bad.append(f"broadcast {tag}")
                send = torch.cat([_value(r, 1, dtype)] * len(members))
                got = hvd.alltoall(send, process_set=ps)
                if not torch.equal(got, torch.cat([_value(m, 1, dtype) for m in members])):
                    bad.append(f"alltoall {tag}")
    finally:
        hvd.shutdown()
    return bad


if __name__ == "__main__":
    from ringpipe.comm import init_world

    world = init_world(os.environ.get("RINGPIPE_BACKEND", "gloo"))
    failed = check(world)
    with open(os.path.join(os.environ["CASES_DIR"], f"rank{world.rank}.json"), "w") as f:
        json.dump(failed, f)
    sys.exit(0)
