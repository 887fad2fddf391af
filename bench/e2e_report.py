"""The end-to-end benchmark's goals, plot and table (bench.run measures, this presents)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# issue #32's e2e goals, as multiples of raw Streams in the same run (bench.goals judges them; these draw them)
GOAL_RATIO = 0.5
GOAL_P99_LOW_X_RAW = 3.0
GOAL_REDIS_X_RAW = 1.3


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The e2e goals, judged on this run (bench.goals holds every goal)."""
    from bench.goals import GOALS

    return [g.judge({"e2e": res}) for g in GOALS if g.source == "e2e"]


LABELS = {"raw": "raw Streams (Lua)", "fencemq_process": "FenceMQ (worker process)",
          "fencemq_thread": "FenceMQ (worker thread)"}
COLORS = {"raw": "#888888", "fencemq_process": "#1f77b4", "fencemq_thread": "#9ecae1"}
PEER_LABELS = {"nats_jetstream": "NATS JetStream (file)", "rabbitmq_quorum": "RabbitMQ (quorum queue)"}


def plot(res: dict[str, Any], lat: dict[str, dict[str, list[int]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["variants"])
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    others = max(v["throughput"]["others_cpu_cores"] for v in res["variants"].values())
    fig.suptitle(f"FenceMQ e2e, QoS1, {res['args']['messages']} x {res['args']['size']} B  "
                 f"(Redis {res['machine']['redis_version']}, {res['machine']['cpus']} CPUs, "
                 f"commit {res['machine']['git_commit']}; unrelated processes used up to {others:.1f} CPUs meanwhile)")

    a = ax[0][0]
    peers = {n: p for n, p in res.get("peers", {}).items() if "msgs_per_s" in p}
    vals = [res["variants"][n]["throughput"]["msgs_per_s"] for n in names] + [p["msgs_per_s"] for p in peers.values()]
    bars = a.bar([LABELS[n] for n in names] + [PEER_LABELS[n] for n in peers], vals,
                 color=[COLORS[n] for n in names] + ["#9e9ac8"] * len(peers))
    a.bar_label(bars, labels=[f"{v / 1000:.1f}k" for v in vals])
    a.axhline(GOAL_RATIO * res["variants"]["raw"]["throughput"]["msgs_per_s"], color="orange", ls=":", lw=1,
              label=f"goal {GOAL_RATIO}x raw")
    a.set_ylabel("msg/s, first publish to last ack")
    a.set_title("end-to-end throughput (peers: bench.peers, same run)")
    a.legend(fontsize=8)
    a.tick_params(axis="x", labelsize=8)
    plt.setp(a.get_xticklabels(), rotation=20, ha="right")

    a = ax[0][1]
    for n in names:
        data = sorted(v / 1e6 for v in lat[n]["low_load"])
        if data:
            a.plot(data, [(i + 1) / len(data) for i in range(len(data))], color=COLORS[n], label=LABELS[n])
    p99_goal = GOAL_P99_LOW_X_RAW * res["variants"]["raw"]["low_load"]["latency_ms"]["p99"]
    a.axvline(p99_goal, color="red", ls="--", lw=1, label=f"goal p99 {GOAL_P99_LOW_X_RAW:g}x raw's ({p99_goal:.2f} ms)")
    a.axhline(0.99, color="black", ls=":", lw=0.8)
    a.set_xscale("log")
    a.set_xlabel("publish -> deliver latency (ms, log)")
    a.set_ylabel("CDF")
    a.set_title(f"low load: {res['args']['low_messages']} PUBs at {res['args']['low_rate']:.0f} msg/s")
    a.legend(fontsize=8)

    a = ax[1][0]
    width = 0.2
    xs = range(len(names))
    for k, (key, label) in enumerate([("p50", "flat-out p50"), ("p99", "flat-out p99")]):
        v = [res["variants"][n]["throughput"]["latency_ms"][key] for n in names]
        bars = a.bar([x + (k - 1.5) * width for x in xs], v, width, label=label, color=["#fdae6b", "#e6550d"][k])
        a.bar_label(bars, labels=[f"{x:.0f}" if x >= 10 else f"{x:.2g}" for x in v], fontsize=7)
    for k, (key, label) in enumerate([("p50", "low-load p50"), ("p99", "low-load p99")]):
        v = [res["variants"][n]["low_load"]["latency_ms"][key] for n in names]
        bars = a.bar([x + (k + 0.5) * width for x in xs], v, width, label=label, color=["#a1d99b", "#31a354"][k])
        a.bar_label(bars, labels=[f"{x:.0f}" if x >= 10 else f"{x:.2g}" for x in v], fontsize=7)
    a.axhline(p99_goal, color="red", ls="--", lw=1)
    a.set_yscale("log")
    a.set_xticks(list(xs), [LABELS[n] for n in names], fontsize=8)
    a.set_ylabel("ms (log)")
    a.set_title("publish -> deliver latency")
    a.legend(fontsize=8)

    a = ax[1][1]
    width = 0.38
    series = [("cpu_us_per_msg", "Redis process CPU (INFO cpu)", "#3182bd"),
              ("evalsha_us_per_msg", "EVALSHA time (INFO commandstats)", "#9ecae1")]
    for k, (key, label, color) in enumerate(series):
        v = [res["variants"][n]["throughput"]["redis"][key] for n in names]
        bars = a.bar([x + (k - 0.5) * width for x in xs], v, width, label=label, color=color)
        a.bar_label(bars, labels=[f"{x:.1f}" for x in v], fontsize=7)
    redis_goal = GOAL_REDIS_X_RAW * res["variants"]["raw"]["throughput"]["redis"]["cpu_us_per_msg"]
    a.axhline(redis_goal, color="red", ls="--", lw=1, label=f"goal {GOAL_REDIS_X_RAW:g}x raw's ({redis_goal:.1f} us)")
    a.set_xticks(list(xs), [LABELS[n] for n in names], fontsize=8)
    a.set_ylabel("Redis us per message (flat-out run)")
    a.set_title("Redis cost per message")
    a.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(res: dict[str, Any]) -> None:
    head = (f"{'variant':<26}{'msg/s':>9}{'x raw':>7}{'p50 ms':>9}{'p99 ms':>9}{'low p50':>9}{'low p99':>9}"
            f"{'redis us/msg':>13}{'lua us/msg':>11}{'client us':>10}{'worker us':>10}{'others':>8}")
    print()
    print(head)
    print("-" * len(head))
    raw = res["variants"]["raw"]["throughput"]["msgs_per_s"]
    for name, v in res["variants"].items():
        t, low = v["throughput"], v["low_load"]
        w = t["worker_cpu_us_per_msg"]
        print(f"{LABELS[name]:<26}{t['msgs_per_s']:>9.0f}{t['msgs_per_s'] / raw:>7.2f}"
              f"{t['latency_ms']['p50']:>9.2f}{t['latency_ms']['p99']:>9.2f}"
              f"{low['latency_ms']['p50']:>9.3f}{low['latency_ms']['p99']:>9.3f}"
              f"{t['redis']['cpu_us_per_msg']:>13.2f}{t['redis']['evalsha_us_per_msg']:>11.2f}"
              f"{t['client_cpu_us_per_msg']:>10.1f}{'' if w is None else f'{w:.1f}':>10}{t['others_cpu_cores']:>8.2f}")
    print("\nruns (median reported): " + "; ".join(
        f"{LABELS[n]}: {', '.join(f'{x / 1000:.1f}k' for x in v['throughput']['runs_msgs_per_s'])} msg/s, "
        f"low p99 {', '.join(f'{x:.2f}' for x in v['low_load']['runs_p99_ms'])} ms"
        for n, v in res["variants"].items()))
    print("client/worker us = CPU of the bench process / worker process per message; others = CPU cores used "
          "meanwhile by unrelated processes on this machine")
    fc = res.get("fence_costs")
    if fc:
        print(f"\nfences alone ({fc['batch']} msgs per call, {fc['calls']} calls):")
        for f in ("publish", "pull", "ack"):
            c = fc[f]
            inner = sorted(((v["usec"], k, v["calls"]) for k, v in c["commands"].items() if k != "evalsha"), reverse=True)[:4]
            top = ", ".join(f"{k} {u / fc['calls']:.0f}us/{calls // fc['calls']}x" for u, k, calls in inner)
            print(f"  {f:<8} EVALSHA {c['evalsha_us_per_call']:7.1f} us/call = {c['evalsha_us_per_msg']:5.2f} us/msg;"
                  f" Python wall {c['python_wall_us_per_call']:7.1f} us/call; inside: {top}")
    plain = res.get("plain_client")
    if plain:
        print(f"\na plain redis-py asyncio client awaiting each call (bench.plain_client): FenceMQ "
              f"{plain['fencemq']['msgs_per_s']:,.0f} msg/s, raw Streams {plain['raw']['msgs_per_s']:,.0f} msg/s "
              f"= {plain['ratio']:.2f}x (pairs: {', '.join(f'{x:.2f}' for x in plain['ratio_per_pair'])}); "
              f"Redis CPU {plain['fencemq']['redis_cpu_us_per_msg']:.1f} vs {plain['raw']['redis_cpu_us_per_msg']:.1f}"
              f" us/msg, worker {plain['fencemq']['worker_cpu_us_per_msg']:.1f} us/msg")
    sdk = res.get("sdk", {})
    if sdk:
        print("\nthe Python SDK through a worker process (bench.sdk): " + ", ".join(
            f"{style} {r['msgs_per_s']:,.0f} msg/s" for style, r in sdk.items()))
    peers = res.get("peers", {})
    if peers:
        ours = res["variants"]["fencemq_process"]["throughput"]["msgs_per_s"]
        print("\npeers, same run, at-least-once (bench.peers):")
        for name, p in peers.items():
            if "msgs_per_s" in p:
                print(f"  {PEER_LABELS[name]:<26} {p['msgs_per_s']:>9,.0f} msg/s  flat-out p99 {p['p99_ms']:8.1f} ms  "
                      f"FenceMQ is {ours / p['msgs_per_s']:.1f}x")
            else:
                print(f"  {PEER_LABELS[name]:<26} skipped: {p['skipped']}")
    print("\ngoals (headline = FenceMQ worker process):")
    for g in res["goals"]:
        verdict = "n/a " if g["pass"] is None else ("PASS" if g["pass"] else "FAIL")
        print(f"  {verdict}  {g['goal']:<44} {g['value']!s:>10}  (target {g['target']})")
