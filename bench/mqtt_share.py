"""MQTT clients through FenceMQ beside the same clients through Mosquitto, in one run.

    python -m bench.mqtt_share [--messages 10000] [--size 128] [--repeat 3]

One paho publisher sends QoS 1 PUBLISHes to a `$share` group of 2 paho subscribers
(bench.mosquitto_peer.mosquitto_share), once through a FenceMQ worker's MQTT listener (its own
process, a private Redis: at least once through Redis) and once through the machine's Mosquitto
on 1883 (in memory; skipped when absent). The median run of each is reported with p50/p99
publish -> receive latency and the ratio. Writes ``<out>/mqtt_share.json``. Goal (issue #17):
FenceMQ >= Mosquitto's throughput at <= its p99.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import ROOT, git_commit
from bench.mosquitto_peer import mosquitto_share
from fencemq.server.embedded import EmbeddedRedis


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = sorted((r for r in runs if "msgs_per_s" in r), key=lambda r: r["msgs_per_s"])
    return ok[(len(ok) - 1) // 2] if ok else (runs[0] if runs else {"skipped": "no run"})


def fencemq_runs(total: int, size: int, repeat: int) -> list[dict[str, Any]]:
    with EmbeddedRedis() as server:
        proc = subprocess.Popen([sys.executable, "-m", "bench.serve_worker", "--redis-url", server.url,
                                 "--mqtt-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()
            mqtt_port = int(proc.stdout.readline().split()[1])
            mosquitto_share(min(2000, total), size, mqtt_port)  # warm-up
            return [mosquitto_share(total, size, mqtt_port) for _ in range(repeat)]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Mosquitto's default max_queued_messages (1000 per client) drops QoS 1 messages of a longer flood:
    # a run that loses some is reported with what arrived, and does not count as a median
    ap.add_argument("--messages", type=int, default=2_000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args(argv)
    print("FenceMQ's MQTT listener, $share group of 2 paho subscribers, QoS 1 ...", flush=True)
    fmq = median_run(fencemq_runs(opts.messages, opts.size, opts.repeat))
    print(f"  {fmq}", flush=True)
    print("Mosquitto on 1883, the same clients ...", flush=True)
    mosq = median_run([mosquitto_share(opts.messages, opts.size) for _ in range(opts.repeat)])
    print(f"  {mosq}", flush=True)
    doc: dict[str, Any] = {"benchmark": "mqtt_share", "git_commit": git_commit(), "args": vars(opts),
                           "fencemq": fmq, "mosquitto": mosq}
    if "msgs_per_s" in fmq and "msgs_per_s" in mosq:
        doc["ratio_msgs_per_s"] = fmq["msgs_per_s"] / mosq["msgs_per_s"]
        doc["p99_ms"] = {"fencemq": fmq["latency_ms"]["p99"], "mosquitto": mosq["latency_ms"]["p99"]}
        print(f"FenceMQ / Mosquitto: {doc['ratio_msgs_per_s']:.2f}x msg/s; p99 {doc['p99_ms']['fencemq']:.1f} ms "
              f"vs {doc['p99_ms']['mosquitto']:.1f} ms")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mqtt_share.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out / 'mqtt_share.json'}")


if __name__ == "__main__":
    main()
