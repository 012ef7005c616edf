"""Tracing's cost on the serving path: the CPU serve bench (benchmarks/serving/serve_bench.py, the
same seeded Poisson load) against `kvserve serve` without and with --otlp-traces-endpoint, in
alternating rounds (off, on, off, on, ...) so that the machine's drift falls on both alike.

The traces go to an OTLP/HTTP sink in a process of its own that reads each post and answers 200
(what a collector does first); it counts posts and bytes, so the run shows the spans really left.

    python benchmarks/obs/tracing_overhead_bench.py --rounds 2 --rate 4 --duration 30 \\
        --json benchmarks/results/serving/cpu_tracing_overhead.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SERVE_BENCH = os.path.join(ROOT, "benchmarks", "serving", "serve_bench.py")


def _sink(port_out: "multiprocessing.Queue", counts: "multiprocessing.Array") -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            counts[0] += 1
            counts[1] += len(body)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.put(server.server_address[1])
    server.serve_forever()


def _run(traced: bool, sink_url: str, args: argparse.Namespace, tag: str) -> dict:
    out = os.path.join(tempfile.gettempdir(), f"tracing-overhead-{tag}.json")
    command = [sys.executable, SERVE_BENCH, "--rates", str(args.rate), "--duration", str(args.duration),
               "--min-tokens", str(args.min_tokens), "--max-tokens", str(args.max_tokens),
               "--seed", str(args.seed), "--json", out, "--"] + shlex.split(args.server_flags)
    if traced:
        command += ["--otlp-traces-endpoint", sink_url]
    print("$", " ".join(shlex.quote(c) for c in command), flush=True)
    subprocess.run(command, check=True)
    with open(out) as fh:
        return json.load(fh)["results"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-flags", default="--kv-cache-memory 1GiB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    ports: multiprocessing.Queue = multiprocessing.Queue()
    counts = multiprocessing.Array("q", 2)
    sink = multiprocessing.Process(target=_sink, args=(ports, counts), daemon=True)
    sink.start()
    sink_url = f"http://127.0.0.1:{ports.get(timeout=10)}"
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    exported: list[dict] = []
    try:
        for round_index in range(args.rounds):
            for mode in ("off", "on"):
                before = (counts[0], counts[1])
                point = _run(mode == "on", sink_url, args, f"{mode}{round_index}")
                runs[mode].append(point)
                if mode == "on":
                    exported.append({"posts": counts[0] - before[0], "bytes": counts[1] - before[1]})
    finally:
        sink.terminate()

    def summary(points: list[dict]) -> dict:
        keys = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
        return {key: statistics.mean(p[key] for p in points) for key in keys if all(key in p for p in points)}

    off, on = summary(runs["off"]), summary(runs["on"])
    ratios = {key: on[key] / off[key] for key in off if key in on and off[key]}
    print("\n             " + "  ".join(f"{key:>20}" for key in off))
    print("tracing off  " + "  ".join(f"{off[key]:20.4f}" for key in off))
    print("tracing on   " + "  ".join(f"{on[key]:20.4f}" for key in off))
    print("on / off     " + "  ".join(f"{ratios[key]:20.4f}" for key in off))
    print(f"exported to the sink per traced run: {exported}")
    if args.json:
        record = {"benchmark": "tracing_overhead_bench",
                  "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rounds": args.rounds,
                  "workload": {"rate": args.rate, "duration_s": args.duration,
                               "max_tokens_uniform": [args.min_tokens, args.max_tokens], "seed": args.seed,
                               "server_flags": args.server_flags},
                  "off": off, "on": on, "on_over_off": ratios, "exported_per_traced_run": exported,
                  "runs": runs}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=2)


if __name__ == "__main__":
    main()
