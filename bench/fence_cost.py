"""What the hot fences cost Redis per message: instructions (callgrind) and EVALSHA time.

    .venv/bin/python -m bench.fence_cost [--rounds 10] [--timed-rounds 200] [--batch 100] [--out bench/results]

Instructions are counted, not timed, so the figure repeats on a loaded
machine: a private redis-server runs under ``valgrind --tool=callgrind
--toggle-collect=evalShaCommand`` (only what EVALSHA runs is counted: the
script, the Redis commands inside it and its reply, not the socket or the
server's cron), and ``callgrind_control -d`` dumps the count after each
call. Time is EVALSHA usec from INFO commandstats on a second, ordinary
private server (it moves with the machine's load; instructions do not).

The workload is the e2e shape: publish a batch, pull it, ack it, repeated,
so the lease sets stay small. The calls are the ones ``Core`` makes (recorded
from a real publish, pull and ack, then replayed), without the lease intent
and schedule writes around them, which are other slots and other calls.

Scenarios: a plain topic with its journal (the default), the same with the
journal off, an lmq (journal off by default; at rest between batches), and push subscriptions:
``push``, one exclusive member with a mailbox of 1,000 (an MQTT subscriber, a
non-shared filter's), and ``push_shared``, a shared group's one member (its
mailbox filled by the group's strategy, unleased while it is alone). A push
subscription's publish is two calls, the publish and the ``dispatch`` that
fills the mailbox, and its PULL takes from the mailbox.
Then the subscribe fence when it preempts (``preempt``): two clients take 50
lmqs from each other, four times. Writes ``fence_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

from bench.bulk_fences import Templates, load_scripts
from bench.harness import ROOT, git_commit, machine_info
from bench.stats import RedisMeter
from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.fences.leases import PULL_REPLY_HEAD
from fencemq.fences.registry import SPECS
from fencemq.model.handles import Handle
from fencemq.server.embedded import EmbeddedRedis, find_server_binary, free_port

FENCES = ("publish", "dispatch", "pull", "ack")  # dispatch: only where the publish fills a mailbox
SCENARIOS: dict[str, dict[str, Any]] = {
    "topic": {"lmq": None, "config": {}},
    "topic_journal_off": {"lmq": None, "config": {"journal_cap": 0}},
    "lmq": {"lmq": "session-1", "config": {}},
    "push": {"lmq": None, "config": {}, "sub": {"capacity": 1000, "mode": "exclusive"}},
    "push_shared": {"lmq": None, "config": {}, "sub": {"capacity": 1000, "mode": "shared"}},
}


class Calls:
    """The EVALSHA of one publish, pull and ack, recorded from Core and replayed with new tags."""

    def __init__(self, shas: dict[str, str], recorded: dict[str, tuple[list[str], list[Any]]]) -> None:
        self.shas, self.recorded = shas, recorded

    @classmethod
    async def record(cls, url: str, config: Config, sync: redis.Redis, topic: str, lmq: str | None,
                     batch: int, size: int, sub: dict[str, Any] | None = None) -> Calls:
        shas = load_scripts(sync)
        conn = redis.asyncio.Redis.from_url(url)
        recorded: dict[str, tuple[list[str], list[Any]]] = {}
        try:
            core = Core(conn, config)
            real = core.fences.call

            async def recording(name: str, keys: list[str], args: list[Any]) -> Any:
                recorded[name] = (list(keys), list(args))
                return await real(name, keys, args)

            core.fences.call = recording  # type: ignore[method-assign]
            joined = await core.subscriptions.subscribe("bench-fence-cost", topic, lmq=lmq, group="g", **(sub or {}))
            handle = Handle.decode(joined.handle)
            await core.publishing.publish(topic, [b"x" * size] * batch, lmq=lmq)
            pulled = await core.leases.pull(handle, batch)
            await core.leases.ack(handle, [d.tag for d in pulled.deliveries])
        finally:
            await conn.aclose()
        return cls(shas, recorded)

    @property
    def fences(self) -> tuple[str, ...]:
        """The fences a round calls, in FENCES' order."""
        return tuple(f for f in FENCES if f in self.recorded)

    def command(self, name: str, tags: list[bytes] | None = None) -> list[Any]:
        keys, args = self.recorded[name]
        args = list(args)
        spec = SPECS[name]
        if "intent_at" in spec.argv:
            args[spec.argv.index("intent_at")] = 2**53 - 1  # an intent that never goes stale: not measured here
        if tags is not None:
            args = args[: len(spec.argv)] + list(tags)
        return ["EVALSHA", self.shas[name], len(keys), *keys, *args]


def tags_of(pull_reply: list[Any]) -> list[bytes]:
    return [pull_reply[i] for i in range(PULL_REPLY_HEAD, len(pull_reply), 4)]


def one_round(r: redis.Redis, calls: Calls, after: Any) -> int:
    """Publish (and dispatch), pull and ack one batch; ``after(name)`` runs after each call. Returns the
    messages pulled."""
    r.execute_command(*calls.command("publish"))
    after("publish")
    if "dispatch" in calls.recorded:
        r.execute_command(*calls.command("dispatch"))
        after("dispatch")
    pulled = r.execute_command(*calls.command("pull"))
    after("pull")
    tags = tags_of(pulled)
    acked = r.execute_command(*calls.command("ack", tags))
    after("ack")
    if acked != len(tags):  # an ack that settles nothing costs nothing: it would measure the wrong thing
        raise RuntimeError(f"the ack settled {acked} of the {len(tags)} messages pulled")
    return len(tags)


class Callgrind:
    """A redis-server under callgrind, counting what EVALSHA runs; ``dump()`` returns the count since the last."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port = workdir, free_port()
        self.out = workdir / "callgrind.out"
        server, _version = find_server_binary()  # FENCEMQ_REDIS_SERVER picks another
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--toggle-collect=evalShaCommand", "--compress-strings=no",
             f"--callgrind-out-file={self.out}",
             server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--zset-max-listpack-entries", "16"],
            stdout=subprocess.DEVNULL, stderr=(workdir / "valgrind.log").open("wb"), start_new_session=True)
        self.dumps = 0
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start under callgrind: "
                                       + (workdir / "valgrind.log").read_text()[-2000:]) from None
                time.sleep(0.2)
        client.close()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def _control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.proc.pid)], check=True, capture_output=True, timeout=60)

    def zero(self) -> None:
        self._control("-z")

    def dump(self) -> int:
        self._control("-d")
        self.dumps += 1
        path = Path(f"{self.out}.{self.dumps}")
        for _ in range(200):  # the dump is written by the server's own thread, soon after the request
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.startswith("totals:") or line.startswith("summary:"):
                        path.unlink()
                        return int(line.split()[1])
            time.sleep(0.05)
        raise RuntimeError(f"no callgrind dump at {path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def count_instructions(scenario: dict[str, Any], rounds: int, batch: int, size: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="fencemq-callgrind-"))
    grind = Callgrind(workdir)
    try:
        config = Config(redis_url=grind.url, **scenario["config"])
        r = redis.Redis.from_url(grind.url)
        calls = asyncio.run(Calls.record(grind.url, config, r, "bench-fence-cost", scenario["lmq"], batch, size,
                                         scenario.get("sub")))
        one_round(r, calls, lambda name: None)  # warm: Lua compiled, keys created
        totals = dict.fromkeys(calls.fences, 0)
        grind.zero()

        def count(name: str) -> None:
            totals[name] += grind.dump()

        pulled = sum(one_round(r, calls, count) for _ in range(rounds))
        r.close()
        per_call = {f: totals[f] / rounds for f in calls.fences}
        return {"rounds": rounds, "pulled": pulled,
                "instructions_per_msg": {f: round(per_call[f] / batch) for f in calls.fences},
                "instructions_per_call": {f: round(per_call[f]) for f in calls.fences}}
    finally:
        grind.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def count_preemptions(lmqs: int, rounds: int) -> dict[str, Any]:
    """Instructions of the subscribe fence when it preempts: clients A and B take ``lmqs`` lmqs from
    each other ``rounds`` times (the fence as Core sends it, lite journal off: the default)."""
    workdir = Path(tempfile.mkdtemp(prefix="fencemq-callgrind-"))
    grind = Callgrind(workdir)
    try:
        config = Config(redis_url=grind.url)
        r = redis.Redis.from_url(grind.url)
        templates = asyncio.run(Templates.record(grind.url, config, r, "bench-preempt"))
        names = [f"p{i:04d}" for i in range(lmqs)]
        pipe = r.pipeline(transaction=False)
        for lmq in names:
            pipe.execute_command(*templates.call("subscribe", lmq, "A")[0:])
        pipe.execute()
        grind.zero()
        total = 0
        for n in range(rounds):
            client, other = ("B", "A") if n % 2 == 0 else ("A", "B")
            pipe = r.pipeline(transaction=False)
            for lmq in names:
                pipe.execute_command(*templates.call("subscribe", lmq, client))
            replies = pipe.execute()
            total += grind.dump()
            assert all(rep[3] == other.encode() for rep in replies), "every timed SUB preempts"
        r.close()
        return {"preemptions": lmqs * rounds, "instructions_per_preemption": round(total / (lmqs * rounds))}
    finally:
        grind.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def time_evalsha(scenario: dict[str, Any], rounds: int, batch: int, size: int) -> dict[str, Any]:
    with EmbeddedRedis() as server:
        r = server.client()
        config = Config(redis_url=server.url, **scenario["config"])
        calls = asyncio.run(Calls.record(server.url, config, r, "bench-fence-cost", scenario["lmq"], batch, size,
                                         scenario.get("sub")))
        one_round(r, calls, lambda name: None)
        meter = RedisMeter(redis.Redis.from_url(server.url))
        usec = dict.fromkeys(calls.fences, 0)

        def timed(name: str) -> None:
            usec[name] += meter.read()["evalsha_usec"]
            meter.reset()

        meter.reset()
        for _ in range(rounds):
            one_round(r, calls, timed)
        machine = machine_info(server, r)
        r.close()
    return {"rounds": rounds, "evalsha_us_per_msg": {f: round(usec[f] / (rounds * batch), 3) for f in usec},
            "machine": machine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="publish/pull/ack rounds counted under callgrind")
    ap.add_argument("--timed-rounds", type=int, default=200, help="rounds timed on an ordinary server")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--no-callgrind", action="store_true", help="time only (valgrind not installed)")
    ap.add_argument("--preempt-lmqs", type=int, default=50, help="lmqs taken back and forth, counted under callgrind")
    opts = ap.parse_args()
    results: dict[str, Any] = {"batch": opts.batch, "size": opts.size, "git": git_commit(), "scenarios": {}}
    machine = None
    for name in opts.scenario or list(SCENARIOS):
        scenario = SCENARIOS[name]
        timed = time_evalsha(scenario, opts.timed_rounds, opts.batch, opts.size)
        machine = timed.pop("machine")
        row = {"evalsha": timed}
        if not opts.no_callgrind and shutil.which("valgrind"):
            row["callgrind"] = count_instructions(scenario, opts.rounds, opts.batch, opts.size)
        results["scenarios"][name] = row
        print(name, json.dumps({k: v.get("instructions_per_msg", v.get("evalsha_us_per_msg"))
                                for k, v in row.items()}), flush=True)
    if not opts.no_callgrind and shutil.which("valgrind"):
        results["preempt"] = count_preemptions(opts.preempt_lmqs, 4)
        print("preempt", json.dumps(results["preempt"]), flush=True)
    results["machine"] = machine
    results["loadavg_at_end"] = os.getloadavg()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fence_cost.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
