"""Worker CPU per message on the e2e flat-out run, and where it goes (cProfile).

    python -m bench.worker_profile [--messages 30000] [--label before] [--out bench/results]

One private Redis; a worker process (bench.serve_worker), one warm-up then one
flat-out e2e run (MPUB of 100, PULL COUNT 100 + ACK, as bench.run does): the
worker's CPU per message from /proc. Then the same under cProfile, for the
functions with the most own time (idle time in the event loop's selector left
out; the profiler's overhead inflates the small, frequent calls). Writes <out>/worker_profile_<label>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import HOST, ROOT, WorkerProcess
from bench.stats import proc_cpu_s
from bench.workloads import FenceMQ, e2e
from fencemq.server.embedded import EmbeddedRedis

# the loop waiting for I/O (epoll.poll, select.select, ...): not work
IDLE = re.compile(r"<(built-in )?method '(poll|select|control)' of 'select\.")


def top_functions(profile: str, limit: int) -> tuple[float, list[dict[str, object]]]:
    stats = pstats.Stats(profile)
    rows = []
    busy = 0.0
    for (file, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if IDLE.match(name):
            continue
        busy += own
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": calls, "own_s": own, "cum_s": cum})
    rows.sort(key=lambda r: r["own_s"], reverse=True)
    for r in rows:
        r["own_share"] = round(r["own_s"] / busy, 4) if busy else 0.0
    return busy, rows[:limit]


def callgrind_instructions(redis_url: str, messages: int, size: int, loop: str | None) -> dict[str, float]:
    """Instructions the worker executes per message (valgrind callgrind): unlike CPU time, the same
    on a busy machine. Instrumentation is switched on for the flat-out run only."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
               sys.executable, "-m", "bench.serve_worker", "--redis-url", redis_url]
        if loop:
            cmd += ["--loop", loop]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            port = int(line.split()[1])
            asyncio.run(e2e(HOST, port, lambda i: FenceMQ("cg-warm"), total=2000, size=size))
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
            run = asyncio.run(e2e(HOST, port, lambda i: FenceMQ("cg-flat"), total=messages, size=size))
            subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        total = 0
        for dump in Path(tmp).glob("callgrind.out*"):
            for text_line in dump.read_text(errors="replace").splitlines():
                if text_line.startswith(("summary:", "totals:")):
                    total = max(total, int(text_line.split()[1]))
    return {"instructions_per_msg": round(total / max(1, run.messages)), "messages": run.messages,
            "msgs_per_s_under_valgrind": round(run.messages / run.seconds) if run.seconds else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=30_000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--label", default="now")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--keep", default=None, help="also keep the cProfile data in this file")
    ap.add_argument("--callgrind", type=int, default=0, metavar="N",
                    help="also count the worker's instructions per message over N messages under valgrind")
    ap.add_argument("--loop", default=None, help="the worker's event loop for --callgrind (default: its own)")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        profile = str(Path(tmp) / "worker.prof")
        measured = {}
        for name, prof in (("plain", None), ("profiled", profile)):
            worker = WorkerProcess(server.url, profile=prof)
            try:
                asyncio.run(e2e(HOST, worker.port, lambda i: FenceMQ(f"warm-{name}"), total=5000, size=opts.size))
                c0 = proc_cpu_s(worker.pid)
                run = asyncio.run(e2e(HOST, worker.port, lambda i: FenceMQ(f"flat-{name}"), total=opts.messages,
                                      size=opts.size))
                measured[name] = (run, proc_cpu_s(worker.pid) - c0)
            finally:
                worker.stop()
            server.client().flushall()
        if opts.callgrind:
            server.client().flushall()
            measured["callgrind"] = callgrind_instructions(server.url, opts.callgrind, opts.size, opts.loop)
        busy, top = top_functions(profile, opts.top)
        if opts.keep:
            shutil.copyfile(profile, opts.keep)
    (run, cpu), (prun, pcpu) = measured["plain"], measured["profiled"]
    result = {
        "label": opts.label,
        "messages": run.messages,
        "msgs_per_s": round(run.messages / run.seconds) if run.seconds else 0,
        "worker_cpu_us_per_msg": round(cpu / max(1, run.messages) * 1e6, 2),
        "worker_cpu_us_per_msg_profiled": round(pcpu / max(1, prun.messages) * 1e6, 2),
        "profiled_busy_s_incl_warmup": round(busy, 3),
        "callgrind": measured.get("callgrind"),
        "top_own_time": top,
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"worker_profile_{opts.label}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{run.messages} messages, {result['msgs_per_s']:,} msg/s; worker CPU {result['worker_cpu_us_per_msg']} "
          f"us/msg ({result['worker_cpu_us_per_msg_profiled']} under cProfile)")
    if result["callgrind"]:
        print(f"under valgrind: {result['callgrind']['instructions_per_msg']:,} worker instructions per message")
    for r in top:
        print(f"  {r['own_share']:6.1%}  {r['calls']:>9}  {r['function']}")


if __name__ == "__main__":
    main()
