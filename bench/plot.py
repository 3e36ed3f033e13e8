"""The benchmark's PNG: steady-state latency CDFs and catch-up throughput over time.

Drawn from the JSON alone, so an old result can be re-plotted:

    python -m bench.plot bench/results/latest.json bench/results/latest.png

Needs matplotlib (Agg backend, no display). Without it, :func:`plot` returns a message instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.report import P99_MS_MAX, title


def plot(result: dict[str, Any], path: Path) -> str | None:
    """Write the PNG to ``path``; returns why not when matplotlib is missing."""
    try:
        # Optional: mypy stays clean whether or not it is installed.
        import matplotlib  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"

    scenarios: dict[str, dict[str, Any]] = result["scenarios"]
    steady = {k: v for k, v in scenarios.items() if v["kind"] == "steady"}
    catchup = {k: v for k, v in scenarios.items() if v["kind"] == "catchup"}
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    for index, (key, data) in enumerate(steady.items()):
        color = colors[index % len(colors)]
        consumer = data["latency_ms"]  # None: the consumer read after the window
        if consumer is not None:
            left.plot(
                [max(v, 0.01) for _, v in consumer["cdf"]],
                [q for q, _ in consumer["cdf"]],
                color=color,
                label=f"{title(key, data)}: insert→consumer p50 {consumer['p50']:.1f}, "
                f"p99 {consumer['p99']:.1f} ms",
            )
        relay = data.get("relay_histogram", {}).get("cdf")
        if relay:  # the relay's histogram: exact at its bucket bounds only
            left.plot(
                [max(v, 0.01) for v, _ in relay],
                [q for _, q in relay],
                color=color,
                linestyle="--",
                marker=".",
                label=f"{title(key, data)}: relay commit→Kafka ack (at its bucket bounds)",
            )
    left.axvline(
        P99_MS_MAX, color="grey", linestyle=":", label=f"target commit→ack p99 ≤ {P99_MS_MAX:g} ms"
    )
    left.axhline(0.99, color="grey", linestyle="--", linewidth=0.6)
    left.set_xscale("log")
    left.set_xlabel("latency, ms (log)")
    left.set_ylabel("fraction of events")
    left.set_title("Steady state: end-to-end latency (CDF)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8, loc="lower right")

    for index, (key, data) in enumerate(catchup.items()):
        color = colors[index % len(colors)]
        right.plot(*_rates(data["throughput"]), color=color, label=f"{title(key, data)}: relay")
        peers = [(n, peer) for n, peer in data.get("peers", {}).items() if "throughput" in peer]
        for style, (name, peer) in zip((":", "-."), peers, strict=False):
            right.plot(*_rates(peer["throughput"]), color=color, linestyle=style, label=name)
        baseline = data["pg_recvlogical"]["rows_per_s"]
        right.axhline(
            baseline,
            color=color,
            linestyle="--",
            linewidth=0.8,
            label=f"pg_recvlogical average ({baseline:,} rows/s)",
        )
    right.set_xlabel("seconds since the program's launch")
    right.set_ylabel("events acknowledged by Kafka per second")
    right.set_title("Catch-up: throughput over time (relay /status, peer counted on the broker)")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8, loc="best")

    machine = result.get("machine", {})
    figure.suptitle(
        f"cdc-relay benchmark ({result.get('mode', '?')}) — {machine.get('cpu_model', '?')}, "
        f"{machine.get('cores', '?')} cores, PostgreSQL {machine.get('postgresql', '?')}",
        fontsize=11,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def _rates(series: dict[str, list[float]]) -> tuple[list[float], list[float]]:
    """(interval midpoints, events per second) from cumulative samples."""
    times, published = series["t"], series["published"]
    steps = [i for i in range(1, len(times)) if times[i] > times[i - 1]]
    mids = [(times[i] + times[i - 1]) / 2 for i in steps]
    rates = [(published[i] - published[i - 1]) / (times[i] - times[i - 1]) for i in steps]
    return mids, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args()
    message = plot(json.loads(args.json.read_text()), args.png)
    print(message or f"wrote {args.png}")


if __name__ == "__main__":
    main()
