"""The elastic driver: Horovod's elastic job run from the launching host, workers kept across membership changes.

``ringpipe-horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh python train.py``
(or ``ringpipe launch`` with the same options, or ``ringpipe.run(..., min_num_proc=...)``) runs
:func:`run_elastic`, which behaves as Horovod's elastic driver (horovod/runner/elastic/driver.py):

* every second it runs the discovery script (or takes the fixed ``-H`` / ``--hostfile`` set) and
  keeps the usable hosts: discovered, not blacklisted (``RINGPIPE_ELASTIC_DISCOVERY_SECONDS`` sets
  another interval, as Horovod's own tests patch its driver's ``DISCOVER_HOSTS_FREQUENCY_SECS``: a
  shorter one notices added hosts and hosts back from the blacklist sooner);
* it serves the job's key-value store and publishes world versions in it
  (:mod:`ringpipe.comm.elastic_rendezvous`); each worker joins the newest, its process group
  meeting under the version's own keys. The first world waits for ``-np`` slots, later ones for
  ``--min-np``, each at most ``--elastic-timeout`` seconds;
* hosts added: the new slots' workers start, a new version is published, and the running workers
  see it at their next ``state.commit()`` (``HostsUpdatedInterrupt``); the new ones get the state
  from rank 0 by the state's sync. Hosts removed: a version without their workers is published;
  they leave at their next commit (and are stopped if they have not left within the timeout);
* a worker that fails (non-zero status, a signal): its host is blacklisted (with
  ``--blacklist-cooldown-range``, until a cooldown ends), the host's other workers are stopped,
  and a version without them is published; the survivors, whose collectives failed, restore
  their last commit and join it;
* a world lost while every worker lives (a collective timed out, a process group that could not
  be made because a member came after its timeout): its workers come back to wait for a newer
  one (``elastic/v<V>/lost``), and once all of them wait the same workers are published as a
  new version; more than ``_LOST_IN_A_ROW`` such losses in a row, each soon after the world was
  made, end the job (the workers fail the same way every time);
* surviving workers keep the lowest ranks, in their order (rank 0 stays on a survivor);
* the job ends when a worker succeeds (the others are given time to finish), and fails, naming
  the cause, when every worker failed, every host is blacklisted, fewer than ``--min-np`` slots
  remain after ``--elastic-timeout``, or the world is re-formed more than ``--reset-limit`` times.
  Every worker is stopped before the driver returns.

Workers on ``localhost``, ``127.0.0.1``, any loopback address or this machine's own names run
here; others are started over ssh (``ssh [options] HOST 'cd CWD && env ... python bootstrap.py ...'``).
Each worker's lines are prefixed with ``[host[slot]]``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringpipe.launch import bootstrap
from ringpipe.launch.elastic_hosts import (
    Blacklist,
    DiscoveryError,
    SlotInfo,
    WorkerKey,
    assign,
    parse_discovery,
)
from ringpipe.launch.hosts import is_local, parse_host_list, read_hostfile
from ringpipe.launch.options import LaunchOptions
from ringpipe.launch.speaker import label

__all__ = ["run_elastic", "ElasticDriver", "RESET_LIMIT_EXCEEDED", "FAILED_MESSAGE", "discovery_interval"]

#: Seconds between two runs of the discovery script (Horovod's interval), unless
#: ``RINGPIPE_ELASTIC_DISCOVERY_SECONDS`` says otherwise.
DISCOVER_EVERY_S = 1.0
DISCOVERY_SECONDS = "RINGPIPE_ELASTIC_DISCOVERY_SECONDS"
#: Horovod's message when the resets exceed ``--reset-limit``.
RESET_LIMIT_EXCEEDED = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"
#: Horovod's message when workers failed and the job cannot go on.
FAILED_MESSAGE = ("Horovod detected that one or more processes exited with non-zero status, thus causing the "
                  "job to be terminated")
_FINISH_GRACE_S = 60.0
_SETTLE_S = 0.5
_STUCK_S = 3.0
#: A world lost with every worker alive is made again at most this many times in a row, each lost
#: within _STABLE_S of being made: the workers then fail the same way every time, and the job ends.
_LOST_IN_A_ROW = 5
_STABLE_S = 10.0
_BOOTSTRAP = os.path.abspath(bootstrap.__file__)


def discovery_interval(env: dict[str, str] | None = None) -> float:
    """Seconds between two discoveries: ``RINGPIPE_ELASTIC_DISCOVERY_SECONDS``, or Horovod's 1 s."""
    raw = (os.environ if env is None else env).get(DISCOVERY_SECONDS, "").strip()
    if not raw:
        return DISCOVER_EVERY_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{DISCOVERY_SECONDS}={raw!r}: give the seconds between two discoveries, "
                         f"a number above 0 (unset: {DISCOVER_EVERY_S:g})")
    return seconds


class JobEnded(Exception):
    """The elastic job cannot go on; the message names the cause."""


@dataclass
class Worker:
    key: WorkerKey
    proc: subprocess.Popen[bytes]
    started: float
    leaving: bool = False  # stopped by the driver or told to leave: its exit is no failure
    relay: threading.Thread | None = None

    @property
    def name(self) -> str:
        return f"{self.key[0]}[{self.key[1]}]"


@dataclass
class _Lines:
    lock: threading.Lock = field(default_factory=threading.Lock)

    def relay(self, stream: Any, tag: str) -> threading.Thread:
        def run() -> None:
            for raw in iter(stream.readline, b""):
                text = raw.decode(errors="replace")
                with self.lock:
                    sys.stdout.write(f"[{tag}]: {text}" if text.endswith("\n") else f"[{tag}]: {text}\n")
                    sys.stdout.flush()

        thread = threading.Thread(target=run, daemon=True, name=f"ringpipe-elastic-{tag}")
        thread.start()
        return thread


def _say(text: str) -> None:
    print(f"{label()}: {text}", file=sys.stderr, flush=True)


class ElasticDriver:
    """One elastic job: discovery, the versions of the world, the workers (see the module's docstring)."""

    def __init__(self, opts: LaunchOptions, discover: Callable[[], list[tuple[str, int]]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch.distributed as dist

        self.opts = opts
        self.discover = discover
        self.clock = clock
        self.discover_every = discovery_interval()
        self.min_np = int(opts.min_np or opts.nprocs or 1)
        self.max_np = opts.max_np
        self.timeout = float(opts.elastic_timeout if opts.elastic_timeout is not None else 600)
        self.reset_limit = opts.reset_limit
        self.blacklist = Blacklist(opts.blacklist_cooldown_range)
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, multi_tenant=False,
                                   timeout=datetime.timedelta(seconds=30))
        self.port = int(self.store.port)
        self.workers: dict[WorkerKey, Worker] = {}
        self.world: list[SlotInfo] = []
        self.version = 0
        self.resets = 0
        self.host_order: list[str] = []
        self.available: list[tuple[str, int]] = []
        self.failed: list[str] = []
        self.lines = _Lines()
        self.succeeded_at: float | None = None
        self.waiting_since: float | None = None
        self._discovered_once = False
        self.pending: list[str] = []
        self.announced_at = 0.0
        self.after_failure = False  # the current version was made because a worker failed
        self.failures_handled = 0
        self.remaking = False  # the next version remakes a lost one
        self.formed_at: float | None = None  # when every member of the current version made its group
        self.lost_in_a_row = 0

    # ----------------------------------------------------------------------------- hosts
    def refresh_hosts(self) -> None:
        """Run discovery; keep the usable hosts (the first failure ends the job, later ones warn)."""
        try:
            found = self.discover()
        except (DiscoveryError, OSError, subprocess.SubprocessError) as exc:
            if not self._discovered_once:
                raise JobEnded(f"host discovery failed: {exc}") from None
            _say(f"host discovery failed ({exc}); keeping the hosts found before")
            return
        self._discovered_once = True
        for host, _ in found:
            if host not in self.host_order:
                self.host_order.append(host)
        now = self.clock()
        self.available = [(h, s) for h, s in found if s > 0 and not self.blacklist.blocked(h, now)]

    # ----------------------------------------------------------------------------- workers
    def _env(self, place: SlotInfo, local: bool, version: int) -> dict[str, str]:
        from ringpipe.launch import remote, runners

        addr = "127.0.0.1" if local else (runners.source_address(place.host) or "127.0.0.1")
        env = {
            "RINGPIPE_ELASTIC_DRIVER": f"{addr}:{self.port}",
            "RINGPIPE_ELASTIC_WORKER": f"{place.host}[{place.slot}]",
            "RINGPIPE_ELASTIC_FIRST_VERSION": str(version),
            "RINGPIPE_BACKEND": self.opts.backend,
            "MASTER_ADDR": addr, "MASTER_PORT": str(self.port),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            **place.env(),
        }
        if not local:
            env = {**remote.forwarded_env(self.opts), **env, remote.STDIN_EOF: "1"}
        return env

    def start_worker(self, place: SlotInfo, version: int) -> None:
        """Start ``place``'s worker for world ``version`` (it joins no older one)."""
        from ringpipe.launch import remote

        local = is_local(place.host)
        env = self._env(place, local, version)
        command = [sys.executable, *self.opts.python, "-u", _BOOTSTRAP, *self.opts.program]
        if local:
            full = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RINGPIPE_LAUNCH_"))}
            proc = subprocess.Popen(command, env={**full, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        else:
            words = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            line = f"cd {shlex.quote(os.getcwd())} && env {words} {shlex.join(command)}"
            proc = subprocess.Popen([*remote.ssh_prefix(self.opts), place.host, line], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
        worker = Worker(place.key, proc, self.clock())
        assert proc.stdout is not None
        worker.relay = self.lines.relay(proc.stdout, worker.name)
        self.workers[place.key] = worker

    def stop_worker(self, worker: Worker, sig: int = signal.SIGTERM) -> None:
        worker.leaving = True
        if worker.proc.poll() is None:
            with contextlib.suppress(OSError):
                worker.proc.send_signal(sig)
            if worker.proc.stdin is not None:  # a remote worker ends when its ssh's input closes
                with contextlib.suppress(OSError):
                    worker.proc.stdin.close()

    def retire(self, worker: Worker) -> None:
        """Stop a leaving worker and wait for it (10 s, then SIGKILL), so that its slot can take a new one."""
        self.stop_worker(worker)
        try:
            worker.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()
        if worker.relay is not None:
            worker.relay.join(timeout=2)
        del self.workers[worker.key]

    def stop_all(self) -> None:
        for worker in self.workers.values():
            self.stop_worker(worker)
        deadline = time.monotonic() + 10
        for worker in self.workers.values():
            try:
                worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        for worker in self.workers.values():
            if worker.relay is not None:
                worker.relay.join(timeout=2)

    # ----------------------------------------------------------------------------- versions
    def publish(self, world: list[SlotInfo]) -> None:
        """Make ``world`` the next version: places, leaves, start new workers, then the version number."""
        if self.version:
            if self.reset_limit is not None and self.resets >= self.reset_limit:
                raise JobEnded(RESET_LIMIT_EXCEEDED.format(self.reset_limit))
            self.resets += 1
        version = self.version + 1
        members = {p.key for p in world}
        for place in world:  # a slot whose worker was told to leave (its host removed, now back) gets a new one
            old = self.workers.get(place.key)
            if old is not None and old.leaving:
                self.retire(old)
        added = [p for p in world if p.key not in self.workers or self.workers[p.key].proc.poll() is not None]
        for place in world:
            self.store.set(f"elastic/v{version}/{place.host}[{place.slot}]", json.dumps(place.env()))
        for key, worker in self.workers.items():
            if key not in members and worker.proc.poll() is None:
                worker.leaving = True
                self.store.set(f"elastic/v{version}/{worker.name}", "leave")
        self.store.set(f"elastic/v{version}/added", "1" if added and self.version else "0")
        for place in added:  # a worker on a slot used before (a host back from the blacklist) waits anew
            self.store.delete_key(f"elastic/waiting/{place.host}[{place.slot}]")
            self.start_worker(place, version)
        self.version, self.world = version, world
        # the running workers are told (the version number) once every new worker waits to join,
        # so that none of them waits in the rendezvous for an interpreter still starting
        self.pending = [f"elastic/waiting/{p.host}[{p.slot}]" for p in added]
        hosts = ", ".join(f"{h}:{sum(1 for p in world if p.host == h)}" for h in dict.fromkeys(p.host for p in world))
        _say(f"world {version}: {len(world)} worker(s) on {hosts}"
             + (f" ({len(added)} new)" if added and version > 1 else ""))
        self.announce()

    def announce(self) -> None:
        """Publish the current version's number once its new workers wait to join."""
        if self.pending and not self.store.check(self.pending):
            return
        self.pending = []
        self.store.set("elastic/version", str(self.version))
        self.announced_at = self.clock()

    def replace_stuck(self) -> None:
        """After a failure: a survivor that has not come to the new world within ``_STUCK_S`` is replaced.

        A worker blocked in a collective of the old world with peers that went on to the new one
        waits there until Gloo's timeout; its process is stopped and a new one started on the
        same slot (its host is not blacklisted; the new worker gets the state by the sync). Rank 0
        of the new world, whose state the others receive, is never replaced.
        """
        if not self.after_failure or self.pending or not self.version:
            return
        if self.clock() - self.announced_at < _STUCK_S:
            return
        self.after_failure = False
        for place in self.world:
            worker = self.workers.get(place.key)
            name = f"{place.host}[{place.slot}]"
            if worker is None or worker.leaving or self.store.check([f"elastic/v{self.version}/joined/{name}"]):
                continue
            if place.rank == 0:  # rank 0 holds the state the others sync from: it is waited for instead
                continue
            _say(f"worker {name} has not come to world {self.version} within {_STUCK_S:g} s (blocked in a "
                 "collective of the old world): replacing it")
            self.stop_worker(worker, signal.SIGKILL)
            worker.proc.wait()
            del self.workers[place.key]
            self.store.delete_key(f"elastic/waiting/{name}")
            self.start_worker(place, self.version)

    def live_members(self) -> list[SlotInfo]:
        """The places of the current world whose workers run and were not told to leave."""
        return [p for p in self.world if p.key in self.workers and not self.workers[p.key].leaving]

    def lost(self) -> bool:
        """Whether every live member of the current version came back to wait for a newer one.

        They do when the version's world was lost with no worker ending (a collective timed out, a
        process group could not be made because a member came after its timeout): nothing else
        would make the next version. A member that is still ending (a failure the loop will reap)
        never comes back, so a failure is never taken for a lost world.
        """
        key = f"elastic/v{self.version}/lost"
        if not self.version or self.pending or not self.store.check([key]):
            return False
        alive = self.live_members()
        return bool(alive) and int(self.store.add(key, 0)) >= len(alive)

    def formed(self) -> bool:
        """Whether every member of the current world has made its process group."""
        key = f"elastic/v{self.version}/ready"
        return bool(self.version) and not self.pending and self.store.check([key]) and int(self.store.add(key, 0)) >= len(self.world)

    # ----------------------------------------------------------------------------- the loop
    def reap(self) -> bool:
        """Collect ended workers; True when one of the current world failed."""
        failed = False
        now = self.clock()
        members = {p.key for p in self.world}
        for key, worker in list(self.workers.items()):
            code = worker.proc.poll()
            if code is None:
                continue
            if worker.relay is not None:
                worker.relay.join(timeout=2)
            del self.workers[key]
            if worker.leaving or key not in members:
                continue
            if code == 0:
                if self.succeeded_at is None:
                    self.succeeded_at = now
                continue
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            self.failed.append(f"{worker.name} ({how})")
            failed = True
            host = key[0]
            if not self.blacklist.blocked(host, now):
                until = self.blacklist.add(host, now)
                cooldown = "" if until == float("inf") else f" for {until - now:.0f} s"
                _say(f"worker {worker.name} failed ({how}); blacklisting host {host}{cooldown}")
            for other in self.workers.values():  # the host's other workers go with it
                if other.key[0] == host:
                    self.stop_worker(other)
        return failed

    def next_world(self, first: bool) -> list[SlotInfo] | None:
        """The next world from the live workers and the usable hosts, or None while too few slots."""
        survivors = [p.key for p in self.live_members()]
        now = self.clock()
        usable = [(h, s) for h, s in self.available if not self.blacklist.blocked(h, now)]
        world = assign(survivors, usable, self.max_np, self.host_order)
        need = int(self.opts.nprocs or 1) if first else self.min_np
        if len(world) < need:
            return None
        return world

    def run(self) -> int:
        last_discovery = -self.discover_every
        need_new = True  # the first world
        settle_until = 0.0
        while True:
            now = self.clock()
            if now - last_discovery >= self.discover_every:
                self.refresh_hosts()
                last_discovery = now
            failed = self.reap()
            if self.pending:
                self.announce()
            self.replace_stuck()
            if self.succeeded_at is not None:
                return self._finish()
            members_alive = self.live_members()
            now = self.clock()
            blacklisted = bool(self.host_order) and all(self.blacklist.blocked(h, now) for h in self.host_order)
            if self.version and not members_alive:
                causes = []
                if failed:
                    causes.append(f"every worker of world {self.version} failed ({', '.join(self.failed)})")
                if blacklisted:
                    causes.append("every host is blacklisted")
                if causes:
                    raise JobEnded(f"{FAILED_MESSAGE}: {'; '.join(causes)}")
                if not self.available:
                    raise JobEnded("every worker of the job left, and no host is left to start one on")
            if failed:
                need_new = True
                # the failed worker's peers that fail too (not just lose it) exit within moments:
                # the next world is made once they are counted (Horovod waits for every worker's record)
                settle_until = self.clock() + _SETTLE_S
                if blacklisted and not members_alive:
                    raise JobEnded(f"{FAILED_MESSAGE}: every host is blacklisted (failed: {', '.join(self.failed)})")
            formed = not need_new and self.formed()  # one look at the store per turn of the loop
            if formed and self.formed_at is None:
                self.formed_at = self.clock()
            if not need_new and self.lost():
                stable = self.formed_at is not None and self.clock() - self.formed_at >= _STABLE_S
                self.lost_in_a_row = 1 if stable else self.lost_in_a_row + 1
                if self.lost_in_a_row > _LOST_IN_A_ROW:
                    raise JobEnded(f"world {self.version} was lost with every worker alive {self.lost_in_a_row} "
                                   f"times in a row, each within {_STABLE_S:g} s of being made: the workers fail "
                                   "the same way every time (their last lines above say how)")
                need_new = self.remaking = True
                _say(f"world {self.version} was lost with every worker alive (a collective failed or timed out, "
                     "or the process group could not be made): making it again")
            candidate = self.next_world(first=not self.version)
            if candidate is not None and not need_new and formed:
                need_new = [p.key for p in candidate] != [p.key for p in self.world]
            if need_new and self.clock() >= settle_until:
                if candidate is None:
                    if self.waiting_since is None:
                        self.waiting_since = self.clock()
                        need = self.opts.nprocs if not self.version else self.min_np
                        _say(f"waiting up to {self.timeout:g} s for {need} slot(s) "
                             f"({sum(s for _, s in self.available)} available)")
                    elif self.clock() - self.waiting_since > self.timeout:
                        need = self.opts.nprocs if not self.version else self.min_np
                        text = (f"Timed out waiting for available slots. Please check that you have enough "
                                f"resources to run at least {need} Horovod processes.")
                        raise JobEnded(f"{FAILED_MESSAGE}: {text}" if self.failed else text)
                else:
                    if self.version and not any(p.key in self.workers for p in candidate):
                        raise JobEnded("No hosts from previous set remaining, unable to broadcast state.")
                    self.waiting_since = None
                    need_new = False
                    self.publish(candidate)
                    self.after_failure = self.remaking or len(self.failed) > self.failures_handled
                    self.remaking, self.formed_at = False, None
                    self.failures_handled = len(self.failed)
            time.sleep(0.05)

    def _finish(self) -> int:
        """A worker succeeded: give the others time to end; the job's status."""
        deadline = time.monotonic() + _FINISH_GRACE_S
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers.values()):
            time.sleep(0.05)
        self.reap()
        return 0


def _script_discovery(script: str, default_slots: int | None) -> Callable[[], list[tuple[str, int]]]:
    def discover() -> list[tuple[str, int]]:
        out = subprocess.run([os.path.abspath(script)], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise DiscoveryError(f"{script} exited with status {out.returncode}: {out.stderr.strip()[-300:]}")
        return parse_discovery(out.stdout, default_slots)

    return discover


def _fixed_discovery(opts: LaunchOptions) -> Callable[[], list[tuple[str, int]]]:
    hosts = read_hostfile(opts.hostfile) if opts.hostfile else parse_host_list(str(opts.hosts))
    found = [(h.host, h.slots) for h in hosts]
    return lambda: list(found)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_elastic(opts: LaunchOptions) -> int:
    """Run an elastic job (the options were validated); the job's exit status."""
    if opts.host_discovery_script is not None:
        discover = _script_discovery(opts.host_discovery_script, opts.slots_per_host)
    else:
        discover = _fixed_discovery(opts)
    driver = ElasticDriver(opts, discover)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM,)}
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return driver.run()
    except JobEnded as exc:
        _say(str(exc))
        return 1
    except KeyboardInterrupt:
        _say("interrupted; every worker was stopped")
        return 130
    finally:
        driver.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
