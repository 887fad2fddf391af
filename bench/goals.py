"""The speed goals (issues #32 and #14), pass or fail, from what the benchmarks of one `make bench` wrote.

    python -m bench.goals [--results bench/results]

Reads e2e.json (bench.run: FenceMQ beside raw Streams, a plain redis-py client against both, the
SDK, NATS JetStream and RabbitMQ), fanout.json (bench.fanout, with raw Streams' Redis CPU per
message measured beside it), preempt_rate.json (bench.preempt_rate), lmq_memory.json
(bench.lmq_memory), scale.json (bench.scale) and connections.json (bench.connections, issue #28:
memory per idle connection, connect rate, a reconnect storm, PING beside 50,000); writes goals.json and goals.png (each goal's
measured value against its target, as a ratio: 1.0 or better passes) and prints the table.
A goal whose benchmark did not run is listed as not measured, never as passed; one missed for a
reason its value does not show (a storm in time but not every client answered) fails with ``why``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Goal:
    name: str
    source: str  # the results file it is read from
    target: float
    unit: str
    higher_is_better: bool
    read: Callable[[dict[str, Any]], float | None]
    # a reason the goal is missed that its value does not show (e.g. a storm that settled in time
    # but not every client was answered), or None
    why: Callable[[dict[str, Any]], str | None] | None = None

    def judge(self, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        doc = results.get(self.source)
        try:
            value = None if doc is None else self.read(doc)
        except (KeyError, TypeError, IndexError, ZeroDivisionError):
            value = None
        row: dict[str, Any] = {"goal": self.name, "target": f"{'>=' if self.higher_is_better else '<='} "
                                                            f"{self.target:g} {self.unit}".strip(),
                               "source": self.source, "value": None if value is None else round(value, 3)}
        if value is None:
            row.update({"pass": None, "score": None})
        else:
            score = value / self.target if self.higher_is_better else (self.target / value if value else float("inf"))
            why = self.why(doc) if self.why is not None and doc is not None else None
            row.update({"pass": score >= 1.0 and not why, "score": round(score, 3), **({"why": why} if why else {})})
        return row


def _fmq(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["variants"]["fencemq_process"]


def _worker_preempt_rate(doc: dict[str, Any]) -> float | None:
    # through a worker process ("worker_writes" is what a worker sends, timed at Redis alone)
    rates = [r["preemptions_per_s_wall"] for r in doc["runs"] if r.get("variant") == "worker_resp_pipelined_sub"]
    return max(rates) if rates else None


def _fence_preempt(doc: dict[str, Any], key: str) -> float:
    fence = [r for r in doc["runs"] if r.get("variant") == "fence" and not r.get("lite_journal_cap")]
    return fence[0][key]


def _idle_lmq_bytes(doc: dict[str, Any]) -> float:
    default = next(v for k, v in doc["summary"].items() if k.endswith("=0"))
    return default["subscribed_only_B_per_lmq"]


def _shard_redis_us(doc: dict[str, Any]) -> float:
    return max(max(s["redis_cpu_us_per_msg_per_shard"]) for s in doc["sizes"])


def _conn(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A goal of bench.connections, as it judged it (connections.json "goals")."""
    return lambda d: d["goals"][key]["value"]


def _conn_why(key: str) -> Callable[[dict[str, Any]], str | None]:
    return lambda d: d["goals"].get(key, {}).get("why")


def _raw(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["variants"]["raw"]


def _fanout_redis_ratio(doc: dict[str, Any]) -> float:
    per_delivery = doc["summary"]["redis_cpu_us_per_msg"] / doc["shape"]["copies_per_message"]
    return per_delivery / doc["raw"]["redis_cpu_us_per_msg"]


# Issue #32's table first: each a ratio against what ran beside it in the same benchmark (raw Redis
# Streams, or the e2e run), because this machine's speed varies ~3x from day to day. Then issue #14's
# goals that #32 did not restate.
GOALS = [
    Goal("e2e throughput / raw Streams (Lua-batched)", "e2e", 0.5, "x", True,
         lambda d: _fmq(d)["throughput"]["msgs_per_s"] / _raw(d)["throughput"]["msgs_per_s"]),
    Goal("plain redis-py client, one call at a time / raw Streams, same client", "e2e", 0.4, "x", True,
         lambda d: d["plain_client"]["ratio"]),
    Goal("Redis CPU per message / raw's", "e2e", 1.3, "x", False,
         lambda d: _fmq(d)["throughput"]["redis"]["cpu_us_per_msg"] / _raw(d)["throughput"]["redis"]["cpu_us_per_msg"]),
    Goal("worker CPU per message / raw's Redis CPU per message", "e2e", 1.0, "x", False,
         lambda d: _fmq(d)["throughput"]["worker_cpu_us_per_msg"] / _raw(d)["throughput"]["redis"]["cpu_us_per_msg"]),
    Goal("p99 publish->deliver at 1,000 msg/s / raw's p99", "e2e", 3.0, "x", False,
         lambda d: _fmq(d)["low_load"]["latency_ms"]["p99"] / _raw(d)["low_load"]["latency_ms"]["p99"]),
    Goal("fan-out Redis CPU per delivery / raw's per message", "fanout", 3.0, "x", False, _fanout_redis_ratio),
    Goal("idle lmq memory at 1,000,000 lmqs", "lmq_memory", 120.0, "B", False, _idle_lmq_bytes),
    Goal("SDK asyncio (prefetch=True) / e2e flat-out", "e2e", 0.9, "x", True,
         lambda d: d["sdk"]["async"]["msgs_per_s"] / _fmq(d)["throughput"]["msgs_per_s"]),
    Goal("SDK blocking (prefetch=True)", "e2e", 40_000, "msg/s", True, lambda d: d["sdk"]["sync"]["msgs_per_s"]),
    Goal("e2e / NATS JetStream", "e2e", 5.0, "x", True,
         lambda d: _fmq(d)["throughput"]["msgs_per_s"] / d["peers"]["nats_jetstream"]["msgs_per_s"]),
    Goal("e2e / RabbitMQ quorum queue", "e2e", 20.0, "x", True,
         lambda d: _fmq(d)["throughput"]["msgs_per_s"] / d["peers"]["rabbitmq_quorum"]["msgs_per_s"]),
    Goal("fan-out deliveries through one worker", "fanout", 20_000, "deliveries/s", True,
         lambda d: d["summary"]["deliveries_per_s"]),
    Goal("fan-out e2e / Mosquitto ($share, 2 paho subscribers)", "fanout", 1.0, "x", True,
         lambda d: d["summary"]["e2e_msgs_per_s"] / d["peers"]["mosquitto"]["msgs_per_s"]),
    Goal("preemptions at Redis (subscribe fence alone)", "preempt_rate", 30_000, "/s", True,
         lambda d: _fence_preempt(d, "capacity_at_redis_per_s")),
    Goal("Redis CPU per preemption", "preempt_rate", 50.0, "us", False,
         lambda d: _fence_preempt(d, "redis_cpu_us_per_preemption")),
    Goal("preemptions through one worker", "preempt_rate", 10_000, "/s", True, _worker_preempt_rate),
    Goal("Redis CPU per message on every shard (1-3 masters)", "scale", 7.0, "us", False, _shard_redis_us),
    # issue #28: connections at scale (bench.connections)
    Goal("worker memory per idle RESP connection (named session)", "connections", 8.0, "KB", False,
         _conn("kb_per_idle_resp")),
    Goal("worker memory per idle MQTT 3.1.1 connection", "connections", 8.0, "KB", False, _conn("kb_per_idle_mqtt")),
    Goal("named RESP sessions connected per second, one worker", "connections", 2000, "/s", True,
         _conn("connects_per_s_resp")),
    Goal("MQTT connects per second, one worker", "connections", 2000, "/s", True, _conn("connects_per_s_mqtt")),
    Goal("PING p99 beside 50,000 idle connections on one worker", "connections", 5.0, "ms", False,
         _conn("ping_p99_beside_crowd_ms"), _conn_why("ping_p99_beside_crowd_ms")),
    Goal("20,000 MQTT clients reconnecting at once to 2 workers: settled", "connections", 20.0, "s", False,
         _conn("storm_settle_s"), _conn_why("storm_settle_s")),
]


def judge(results_dir: Path) -> list[dict[str, Any]]:
    results = {}
    for name in {g.source for g in GOALS}:
        path = results_dir / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    return [g.judge(results) for g in GOALS]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 0.45 * len(rows) + 1.5))
    names = [r["goal"] for r in rows][::-1]
    scores = [r["score"] or 0.0 for r in rows][::-1]
    colors = ["#bbbbbb" if r["pass"] is None else ("#2ca02c" if r["pass"] else "#d62728") for r in rows][::-1]
    bars = ax.barh(names, scores, color=colors)
    ax.bar_label(bars, labels=[("not measured" if r["value"] is None else f"{r['value']:g} (target {r['target']})"
                                + (f"; missed: {r['why'][:40]}" if r.get("why") else "")) for r in rows][::-1],
                 fontsize=7, padding=3)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    ax.set_xlim(min(0.5, min(s for s in scores if s) * 0.9), max(2.0, max(scores) * 4))  # room for the labels
    ax.set_xlabel("measured / goal (>= 1 passes; log scale)")
    ax.set_title("FenceMQ speed goals (issues #32, #14, #28), one `make bench` run")
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args(argv)
    out = Path(opts.results)
    rows = judge(out)
    (out / "goals.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, out / "goals.png")
    width = max(len(r["goal"]) for r in rows)
    for r in rows:
        verdict = "not measured" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        print(f"{r['goal']:<{width}}  {verdict:<12} {'' if r['value'] is None else r['value']:>12}  {r['target']}"
              + (f"  ({r['why']})" if r.get("why") else ""))
    print(f"wrote {out / 'goals.json'} and {out / 'goals.png'}")


if __name__ == "__main__":
    main()
