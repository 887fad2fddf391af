"""Connections at scale (issue #28), FenceMQ beside Mosquitto in one run.

    python -m bench.connections [--idle 5000] [--storm 20000] [--crowd 50000] [--processes 4] [--out bench/results]

Every FenceMQ worker runs in its own process (bench.serve_worker, its open-file limit raised to
fit) in front of one private Redis; the clients are a bench.crowd: several processes of raw
sockets with pre-encoded handshakes, their CPU time reported beside the wall time (a crowd that
used less CPU than the wall time was not the bottleneck).

* **Idle connections**: a fresh worker's RSS before and after ``--idle`` named RESP sessions
  (``HELLO 2 SETNAME``), then the same for MQTT 3.1.1 connections, then a fresh Mosquitto of the
  machine's binary (with ``--machine-mosquitto`` the one on 127.0.0.1:1883 as well, a shared
  service whose RSS is a high-water mark of what it served before): bytes per idle connection.
  The rate they connected at (64 handshakes in flight per crowd process) is the connect rate,
  with the worker's CPU per connect; 1,000 one after another (the issue's loop) is reported too,
  once the worker is quiet again (the crowd's sessions ended).
* **PING beside idle clients**: an active client's PING (RESP) or PINGREQ (MQTT, Mosquitto)
  round trips, percentiles, with no other client and beside the idle ones.
* **Reconnect storm**: ``--storm`` MQTT clients with sessions that outlive their connection
  (Clean Session 0) and one subscription each connect to 2 workers, all drop at once (TCP reset,
  no DISCONNECT) and reconnect at once: the time until every one is CONNACKed (session present)
  is the settle time; then one message to each of 500 sampled devices shows that their
  subscriptions deliver again. Mosquitto runs the same storm as a private instance of the same
  binary with its open-file limit raised.
* **A crowd on one worker**: ``--crowd`` idle connections (half RESP, half MQTT) on one worker,
  and an active client's PING beside them.

The bench raises its own open-file limit, hard one included, to fit (root may; otherwise it holds
what fits and says so in the JSON), and notes the load average at the start of every phase: the
machine is shared. Writes ``<out>/connections.json`` and ``connections.png`` (``--replot`` redraws
them from the JSON); bench.goals reads the goals from it. Goals (issue #28): <= 8 KB of worker
memory per idle RESP or MQTT connection; >= 2,000 connects/s per worker (named RESP sessions,
MQTT); the storm settled in <= 20 s with no client refused; PING p99 <= 5 ms beside 50,000 idle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.crowd import Crowd, mqtt_connect, mqtt_publish
from bench.harness import ROOT, WorkerProcess, allow_open_files, git_commit, wait_listening
from bench.stats import percentiles_ms, proc_cpu_s, rss
from fencemq.server.embedded import EmbeddedRedis, free_port
from fencemq.server.file_limit import plan

KB = 1024
SAMPLE = 500  # devices a message is sent to after the storm


@contextlib.contextmanager
def workers(redis_url: str, n: int, max_connections: int, log: Path | None = None) -> Iterator[list[WorkerProcess]]:
    """n worker processes (RESP and MQTT), each allowed ``max_connections`` clients and the files for them;
    their logs appended to ``log`` (else dropped)."""
    started: list[WorkerProcess] = []
    with contextlib.ExitStack() as files:
        err: Any = files.enter_context(log.open("a")) if log else subprocess.DEVNULL
        try:
            for _ in range(n):
                started.append(WorkerProcess(redis_url, extra=["--max-connections", str(max_connections)], mqtt=True,
                                             open_files=max_connections + 2000, stderr=err))
            yield started
        finally:
            for w in started:
                w.stop()


@contextlib.contextmanager
def private_mosquitto(max_connections: int) -> Iterator[tuple[int, int]]:
    """The machine's Mosquitto binary on a free port, in memory, room for ``max_connections``: (port, pid)."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "mosquitto.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest none\n")
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=lambda: allow_open_files(max_connections + 1000))
        try:
            wait_listening(port)
            yield port, proc.pid
        finally:
            proc.terminate()
            proc.wait(10)


def machine_mosquitto_pid(port: int = 1883) -> int | None:
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for part in out.split("pid=")[1:]:
        return int(part.split(",")[0])
    return None


# -- an active client ----------------------------------------------------------------------


def resp_pings(port: int, n: int = 2000) -> dict[str, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            got = b""
            while not got.endswith(b"\r\n"):
                got += s.recv(64)
            times.append(time.perf_counter_ns() - t0)
            time.sleep(0.0005)
    return percentiles_ms(times)


def mqtt_pings(port: int, n: int = 2000) -> dict[str, float]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(mqtt_connect(f"pinger-{os.getpid()}-{time.time_ns()}"))
        assert s.recv(4)[:1] == b"\x20"
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            s.sendall(b"\xc0\x00")
            got = b""
            while len(got) < 2:
                got += s.recv(2 - len(got))
            times.append(time.perf_counter_ns() - t0)
            time.sleep(0.0005)
    return percentiles_ms(times)


def publish_to(port: int, topics: list[str]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(mqtt_connect(f"sampler-{time.time_ns()}"))
        assert s.recv(4)[:1] == b"\x20"
        s.sendall(b"".join(mqtt_publish(t, b"are you there") for t in topics))
        s.sendall(b"\xc0\x00")  # PINGRESP once the publishes before it were read
        s.recv(2)


# -- the measurements ----------------------------------------------------------------------


def _rate(result: dict[str, Any], n: int) -> dict[str, Any]:
    return {"connections": n, "outcome": result["outcome"], "seconds": round(result["wall_s"], 2),
            "per_s": round(result["outcome"].get("accepted", 0) / result["wall_s"], 1),
            "handshake_ms": percentiles_ms(result["latencies_ns"]), "crowd_cpu_s": result["crowd_cpu_s"]}


def wait_quiet(pid: int, timeout: float = 60.0) -> float:
    """Until ``pid`` uses under a tenth of a core over half a second (or ``timeout``): seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        cpu0 = proc_cpu_s(pid)
        time.sleep(0.5)
        if proc_cpu_s(pid) - cpu0 < 0.05:
            break
    return round(time.perf_counter() - t0, 1)


def idle(kind: str, port: int, pid: int, n: int, processes: int, *, ping: Any, prefix: str) -> dict[str, Any]:
    """Bytes of ``pid`` per idle connection of ``kind`` at ``port``; the connect rate; PING beside them."""
    # a few first, so that code paths are warm; not more: the memory they leave behind (free lists,
    # arenas) would be reused by the crowd and hide its cost
    with Crowd(kind, 20, [port], prefix=f"{prefix}warm", processes=1) as warm:
        warm.run("connect")
        warm.run("close")
    time.sleep(1)
    load = os.getloadavg()
    alone = ping(port)
    before = rss(pid)
    with Crowd(kind, n, [port], prefix=prefix, processes=processes) as crowd:
        cpu0 = proc_cpu_s(pid)
        connected = _rate(crowd.run("connect"), n)
        connected["server_cpu_us_per_connect"] = round((proc_cpu_s(pid) - cpu0) / n * 1e6)
        time.sleep(2)
        after = rss(pid)
        beside = ping(port)
        crowd.run("close")
    quiet_s = wait_quiet(pid)  # the crowd's sessions ended: not measured as the one-by-one connects' time
    with Crowd(kind, 1000, [port], prefix=f"{prefix}seq", processes=1, window=1) as one_by_one:
        sequential = _rate(one_by_one.run("connect"), 1000)
        one_by_one.run("close")
    held = connected["outcome"].get("accepted", 0)
    return {"connect": connected, "sequential": {**{k: sequential[k] for k in ("per_s", "seconds", "outcome")},
                                                 "handshake_ms": sequential["handshake_ms"],
                                                 "after_quiet_s": quiet_s},
            "rss_before_mb": round(before / KB / KB, 1), "rss_after_mb": round(after / KB / KB, 1),
            "kb_per_connection": round((after - before) / KB / max(1, held), 2),
            "ping_ms_alone": alone, "ping_ms_beside_idle": beside, "loadavg": load}


def storm(ports: list[int], pids: list[int], n: int, processes: int, *, prefix: str,
          redis_pid: int | None = None) -> dict[str, Any]:
    """n MQTT sessions with a subscription each drop and reconnect at once: time to settle (with the
    CPU the servers, and FenceMQ's Redis, spent on it)."""
    load = os.getloadavg()
    with Crowd("mqtt", n, ports, prefix=prefix, processes=processes, clean=False) as crowd:
        first = _rate(crowd.run("connect"), n)
        print(f"    connected: {first['per_s']}/s {first['outcome']}", flush=True)
        subscribing = crowd.run("subscribe")
        subscribed = subscribing["outcome"].get("subacked", 0)
        print(f"    subscribed: {subscribed} in {subscribing['wall_s']:.1f} s", flush=True)
        time.sleep(2)
        crowd.run("drop")
        cpu0 = [proc_cpu_s(pid) for pid in pids]
        redis_cpu0 = proc_cpu_s(redis_pid) if redis_pid else 0.0
        again = crowd.run("connect", window=n)  # every reconnect at once
        settled = _rate(again, n)
        settled["server_cpu_s"] = [round(proc_cpu_s(pid) - c, 1) for pid, c in zip(pids, cpu0)]
        if redis_pid:
            settled["redis_cpu_s"] = round(proc_cpu_s(redis_pid) - redis_cpu0, 1)
        print(f"    reconnected: {settled['seconds']} s {settled['outcome']}", flush=True)
        sample = [f"dev/{prefix}{i}" for i in range(0, n, max(1, n // SAMPLE))]
        t0 = time.perf_counter()
        received = 0
        try:
            publish_to(ports[0], sample)
            while time.perf_counter() - t0 < 30 and received < len(sample):
                time.sleep(0.5)
                received += crowd.run("received")["outcome"].get("received", 0)
        except OSError as exc:  # the worker too busy to take the sampler's CONNECT: said so
            print(f"    the sample could not be published: {exc}", flush=True)
        delivered_s = time.perf_counter() - t0
        crowd.run("close")
    return {"clients": n, "first_connect": first, "subscribed": subscribed,
            "subscribe_s": round(subscribing["wall_s"], 1),
            "settle_s": settled["seconds"], "reconnect": settled,
            "session_present": settled["outcome"].get("session_present", 0),
            "refused": n - settled["outcome"].get("accepted", 0),
            "sampled": len(sample), "sample_delivered": received, "sample_delivered_within_s": round(delivered_s, 2),
            "loadavg": load}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int, default=5000, help="idle connections per kind (memory, connect rate)")
    ap.add_argument("--storm", type=int, default=20000, help="MQTT clients in the reconnect storm (0: skip)")
    ap.add_argument("--crowd", type=int, default=50000, help="idle connections on one worker beside a PING (0: skip)")
    ap.add_argument("--processes", type=int, default=4, help="crowd processes")
    ap.add_argument("--skip-mosquitto", action="store_true")
    ap.add_argument("--machine-mosquitto", action="store_true",
                    help="also the machine's Mosquitto on 1883 (a shared service: its RSS is a high-water mark)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--worker-log", help="append the storm's workers' logs to this file (refusals, file limits)")
    ap.add_argument("--replot", action="store_true", help="only redraw <out>/connections.png (and the goals) "
                    "from <out>/connections.json")
    opts = ap.parse_args(argv)
    out = Path(opts.out)
    if opts.replot:
        doc = json.loads((out / "connections.json").read_text())
        doc["goals"] = goals(doc)
        (out / "connections.json").write_text(json.dumps(doc, indent=2) + "\n")
        plot(doc, out / "connections.png")
        return
    stamp = f"{int(time.time()) % 100000}-"
    doc: dict[str, Any] = {"benchmark": "connections", "git_commit": git_commit(), "args": vars(opts),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "loadavg_at_start": os.getloadavg(), "cpus": os.cpu_count()}
    t_start = time.perf_counter()
    biggest = max(opts.idle, opts.storm, opts.crowd) + 1000
    # A process may not open more files than its hard limit, and only one with CAP_SYS_RESOURCE may raise
    # it: what one worker (or Mosquitto) can hold here may be fewer than asked for.
    allow_open_files(biggest + 2000)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    room = plan(min(hard, biggest + 2000)).clients
    doc["open_file_hard_limit"] = hard
    crowd = min(opts.crowd, room - 100)
    mosquitto_storm = min(opts.storm, hard - 100)
    if crowd < opts.crowd or mosquitto_storm < opts.storm:
        doc["limited_by_open_files"] = {"crowd_asked": opts.crowd, "crowd_held": crowd,
                                        "mosquitto_storm_asked": opts.storm, "mosquitto_storm": mosquitto_storm,
                                        "why": f"the hard limit on open files here is {hard} and this process may not "
                                               "raise it (no CAP_SYS_RESOURCE)"}
        print(f"open files: hard limit {hard}: {crowd:,} idle connections on one worker at most, "
              f"{mosquitto_storm:,} in Mosquitto's storm", flush=True)
    with EmbeddedRedis() as server:
        for kind, ping in (("resp", resp_pings), ("mqtt", mqtt_pings)) if opts.idle else ():
            print(f"FenceMQ {kind}: {opts.idle} idle connections on a fresh worker ...", flush=True)
            with workers(server.url, 1, biggest) as (w,):
                port = w.port if kind == "resp" else w.mqtt_port
                doc[f"fencemq_{kind}"] = idle(kind, port, w.pid, opts.idle, opts.processes, ping=ping,
                                              prefix=f"{kind}{stamp}")
            print(f"  {_line(doc[f'fencemq_{kind}'])}", flush=True)
        mosquitto = machine_mosquitto_pid() if opts.machine_mosquitto else None
        if opts.machine_mosquitto and not opts.skip_mosquitto and mosquitto is not None:
            print(f"Mosquitto on 1883: {opts.idle} idle connections ...", flush=True)
            doc["mosquitto_1883"] = idle("mqtt", 1883, mosquitto, opts.idle, opts.processes, ping=mqtt_pings,
                                         prefix=f"fmqbench{stamp}")
            print(f"  {_line(doc['mosquitto_1883'])}", flush=True)
        if not opts.skip_mosquitto and shutil.which("mosquitto"):
            # The machine's Mosquitto has served others since it started: its RSS is a high-water mark
            # that 5,000 connections may not move. A fresh one of the same binary says what they cost.
            print(f"a fresh Mosquitto: {opts.idle} idle connections ...", flush=True)
            with private_mosquitto(biggest) as (port, pid):
                doc["mosquitto"] = idle("mqtt", port, pid, opts.idle, opts.processes, ping=mqtt_pings,
                                        prefix=f"fmqfresh{stamp}")
            print(f"  {_line(doc['mosquitto'])}", flush=True)
        if opts.storm:
            print(f"reconnect storm: {opts.storm} MQTT sessions on 2 workers ...", flush=True)
            with workers(server.url, 2, biggest, Path(opts.worker_log) if opts.worker_log else None) as ws:
                doc["storm_fencemq"] = storm([w.mqtt_port for w in ws], [w.pid for w in ws], opts.storm, opts.processes,
                                             prefix=f"st{stamp}", redis_pid=server.pid)
            print(f"  {_storm_line(doc['storm_fencemq'])}", flush=True)
            if not opts.skip_mosquitto and shutil.which("mosquitto"):
                print(f"reconnect storm: {mosquitto_storm} MQTT sessions on a private Mosquitto ...", flush=True)
                with private_mosquitto(biggest) as (port, pid):
                    doc["storm_mosquitto"] = storm([port], [pid], mosquitto_storm, opts.processes, prefix=f"sm{stamp}")
                print(f"  {_storm_line(doc['storm_mosquitto'])}", flush=True)
        if crowd > 0:
            print(f"{crowd} idle connections (half RESP, half MQTT) on one worker, a PING beside ...", flush=True)
            with workers(server.url, 1, biggest) as (w,):
                doc["crowd"] = one_worker_crowd(w, crowd, opts.processes, prefix=f"cr{stamp}")
            print(f"  {doc['crowd']}", flush=True)
    doc["loadavg_at_end"] = os.getloadavg()
    doc["bench_seconds"] = round(time.perf_counter() - t_start)
    doc["goals"] = goals(doc)
    for name, row in doc["goals"].items():
        print(f"{name}: {row}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "connections.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, out / "connections.png")
    print(f"wrote {out / 'connections.json'} and connections.png")


def one_worker_crowd(w: WorkerProcess, n: int, processes: int, *, prefix: str) -> dict[str, Any]:
    load = os.getloadavg()
    alone = resp_pings(w.port)
    before = rss(w.pid)
    half = max(1, processes // 2)
    with Crowd("resp", n // 2, [w.port], prefix=f"{prefix}r", processes=half) as resp, \
            Crowd("mqtt", n - n // 2, [w.mqtt_port], prefix=f"{prefix}m", processes=half) as mqtt:
        r, m = resp.run("connect"), mqtt.run("connect")
        held = r["outcome"].get("accepted", 0) + m["outcome"].get("accepted", 0)
        time.sleep(2)
        after = rss(w.pid)
        beside = resp_pings(w.port)
        resp.run("close")
        mqtt.run("close")
    return {"connections": n, "held": held, "rss_before_mb": round(before / KB / KB, 1),
            "rss_after_mb": round(after / KB / KB, 1), "kb_per_connection": round((after - before) / KB / max(1, held), 2),
            "connect_s": {"resp": round(r["wall_s"], 1), "mqtt": round(m["wall_s"], 1)},
            "ping_ms_alone": alone, "ping_ms_beside_idle": beside, "loadavg": load}


CROWD_GOAL = 50_000  # idle connections the PING goal is set beside


def goals(doc: dict[str, Any]) -> dict[str, Any]:
    """Each goal of issue #28: the value, the target, met or not (None: not measured), Mosquitto's figure
    beside it, and ``why`` when the value alone does not say it is missed."""
    def row(value: float | None, target: float, higher: bool, unit: str, beside: Any = None,
            why: str | None = None) -> dict[str, Any]:
        met = None if value is None else (value >= target if higher else value <= target) and not why
        return {"value": value, "target": f"{'>=' if higher else '<='} {target:g} {unit}", "met": met,
                **({"mosquitto": beside} if beside is not None else {}), **({"why": why} if why else {})}

    mosq = doc.get("mosquitto", {})
    out: dict[str, Any] = {}
    for kind in ("resp", "mqtt"):
        fmq = doc.get(f"fencemq_{kind}", {})
        out[f"kb_per_idle_{kind}"] = row(fmq.get("kb_per_connection"), 8, False, "KB", mosq.get("kb_per_connection"))
        out[f"connects_per_s_{kind}"] = row(fmq.get("connect", {}).get("per_s"), 2000, True, "/s",
                                            mosq.get("connect", {}).get("per_s"))
    st, sm = doc.get("storm_fencemq"), doc.get("storm_mosquitto", {})
    if st:
        short = [f"{what} {got:,} of {want:,}" for what, got, want in (
            ("CONNACKed", st["clients"] - st["refused"], st["clients"]),
            ("with their session", st["session_present"], st["clients"]),
            ("sampled devices delivered to", st["sample_delivered"], st["sampled"])) if got < want]
        out["storm_settle_s"] = row(st["settle_s"], 20, False, "s", sm.get("settle_s"), "; ".join(short) or None)
        out["storm_refused"] = st["refused"]
    crowd = doc.get("crowd")
    if crowd:
        held = crowd["held"]
        out["ping_p99_beside_crowd_ms"] = {
            **row(crowd["ping_ms_beside_idle"].get("p99"), 5, False, "ms", None,
                  f"only {held:,} of {CROWD_GOAL:,} connections held" if held < CROWD_GOAL else None),
            "beside_connections": held}
    return out


def _line(r: dict[str, Any]) -> str:
    return (f"{r['kb_per_connection']} KB each ({r['rss_before_mb']} -> {r['rss_after_mb']} MB), "
            f"{r['connect']['per_s']}/s ({r['connect']['outcome']}, crowd CPU {r['connect']['crowd_cpu_s']} s "
            f"in {r['connect']['seconds']} s, server CPU {r['connect']['server_cpu_us_per_connect']} us each), one by one {r['sequential']['per_s']}/s, PING p99 "
            f"{r['ping_ms_alone'].get('p99', 0):.2f} ms alone, {r['ping_ms_beside_idle'].get('p99', 0):.2f} beside")


def _storm_line(r: dict[str, Any]) -> str:
    return (f"settled in {r['settle_s']} s ({r['reconnect']['outcome']}), refused {r['refused']}, "
            f"sample {r['sample_delivered']}/{r['sampled']} within {r['sample_delivered_within_s']} s; "
            f"first connect {r['first_connect']['per_s']}/s")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4.3))
    mosq = doc.get("mosquitto", {})
    fresh, grey = "#3b6ea8", "#999999"
    st, sm, crowd = doc.get("storm_fencemq", {}), doc.get("storm_mosquitto", {}), doc.get("crowd", {})

    def unanswered(storm_doc: dict[str, Any]) -> str:
        return f"\n{storm_doc['refused']:,} not answered" if storm_doc.get("refused") else ""

    panels = [
        ("KB per idle connection (<= 8)", 8,
         [("FenceMQ RESP", doc.get("fencemq_resp", {}).get("kb_per_connection"), fresh, ""),
          ("FenceMQ MQTT", doc.get("fencemq_mqtt", {}).get("kb_per_connection"), fresh, ""),
          (f"FenceMQ, {crowd.get('held', 0):,} mixed", crowd.get("kb_per_connection"), fresh, ""),
          ("Mosquitto", mosq.get("kb_per_connection"), grey, "")]),
        ("connects/s, one worker (>= 2,000)", 2000,
         [("FenceMQ RESP", doc.get("fencemq_resp", {}).get("connect", {}).get("per_s"), fresh, ""),
          ("FenceMQ MQTT", doc.get("fencemq_mqtt", {}).get("connect", {}).get("per_s"), fresh, ""),
          ("Mosquitto", mosq.get("connect", {}).get("per_s"), grey, "")]),
        (f"storm of {doc['args']['storm']:,} MQTT: settle s (<= 20)", 20,
         [("FenceMQ, 2 workers", st.get("settle_s"), fresh, unanswered(st)),
          (f"Mosquitto ({sm.get('clients', 0):,})", sm.get("settle_s"), grey, unanswered(sm))]),
        ("PING p99 ms (<= 5 beside 50,000 idle)", 5,
         [("FenceMQ alone", crowd.get("ping_ms_alone", {}).get("p99"), fresh, ""),
          (f"beside {crowd.get('held', 0):,}", crowd.get("ping_ms_beside_idle", {}).get("p99"), fresh, ""),
          (f"Mosquitto beside {mosq.get('connect', {}).get('connections', 0):,}",
           mosq.get("ping_ms_beside_idle", {}).get("p99"), grey, "")]),
    ]
    for ax, (title, goal, bars) in zip(axes, panels):
        values = [b[1] or 0 for b in bars]
        ax.bar([b[0] for b in bars], values, color=[b[2] for b in bars])
        ax.axhline(goal, color="#c0392b", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
        ax.set_ylim(0, max(goal, *values) * 1.2)
        for x, (v, bar) in enumerate(zip(values, bars)):
            ax.annotate(f"{v:,.1f}{bar[3]}", (x, v), ha="center", va="bottom", fontsize=8)
    load = f"load {doc['loadavg_at_start'][0]:.1f}" + (f" -> {doc['loadavg_at_end'][0]:.1f}" if "loadavg_at_end" in doc else "")
    fig.suptitle(f"bench.connections @ {doc['git_commit'][:10]}, {doc.get('cpus')} CPUs shared, {load}"
                 + (f"; open files capped at {doc['open_file_hard_limit']:,}" if "limited_by_open_files" in doc else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
