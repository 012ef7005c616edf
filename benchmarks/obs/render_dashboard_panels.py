"""Runs every query of the Grafana dashboard (deploy/grafana/kvserve-dashboard.json) against a
Prometheus through its query_range API and reports, per panel, which queries return data.

    python -m benchmarks.obs.render_dashboard_panels --prometheus http://127.0.0.1:9090 [--json out.json]

This is not Grafana (Grafana is not installable here): it does what each panel's data source would
do, with the dashboard's variables set to "All" ($model_name, $instance = .*) and $__rate_interval
set to --rate-interval, and says whether every panel would draw something after a run. A query that
Prometheus refuses (bad PromQL) is an error; one that answers with no series is "no data" (for
panels of features the server runs without: tiers, latency targets, tenants). Exit status 1 when a
query errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Optional

DASHBOARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "grafana",
                         "kvserve-dashboard.json")


def panel_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, legend, expr) of every query target of every panel, rows' nested panels too."""
    found = []

    def visit(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((panel["title"], target.get("legendFormat", ""), target["expr"]))
            visit(panel.get("panels", []))
    visit(dashboard.get("panels", []))
    return found


def substitute(expr: str, rate_interval: str) -> str:
    """The dashboard's variables as Grafana sends them with "All" chosen."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$model_name", ".*")
            .replace("$instance", ".*"))


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> dict[str, Any]:
    import httpx
    response = httpx.get(prometheus.rstrip("/") + "/api/v1/query_range",
                         params={"query": expr, "start": start, "end": end, "step": step}, timeout=30)
    return response.json()


def check(prometheus: str, dashboard: dict, range_s: float = 300, step_s: float = 5,
          rate_interval: str = "1m", end: Optional[float] = None) -> list[dict[str, Any]]:
    """One row per query: title, legend, expr, status (data / no data / error), series, points and
    the latest finite value of the first series."""
    end = time.time() if end is None else end
    rows = []
    for title, legend, expr in panel_queries(dashboard):
        answer = query_range(prometheus, substitute(expr, rate_interval), end - range_s, end, step_s)
        row = {"panel": title, "legend": legend, "expr": expr, "series": 0, "points": 0, "last": None}
        if answer.get("status") != "success":
            row.update(status="error", error=answer.get("error", "?"))
        else:
            result = answer["data"]["result"]
            finite = [(series, float(v)) for series in result for _, v in series["values"] if math.isfinite(float(v))]
            row.update(series=len(result), points=sum(len(series["values"]) for series in result),
                       status="data" if finite else "no data",
                       last=finite[-1][1] if finite else None)
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="base URL of the Prometheus that scrapes kvserve")
    parser.add_argument("--dashboard", default=DASHBOARD)
    parser.add_argument("--range", type=float, default=300, help="seconds back from now to query")
    parser.add_argument("--step", type=float, default=5)
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    with open(args.dashboard, encoding="utf-8") as f:
        dashboard = json.load(f)
    rows = check(args.prometheus, dashboard, args.range, args.step, args.rate_interval)
    for row in rows:
        detail = row.get("error") or (f"{row['series']} series, last {row['last']:.6g}" if row["last"] is not None
                                      else f"{row['series']} series")
        print(f"{row['status']:8} {row['panel']} / {row['legend']}: {detail}")
    panels = {row["panel"] for row in rows}
    with_data = {row["panel"] for row in rows if row["status"] == "data"}
    print(f"{len(with_data)} of {len(panels)} panels have data; no data: {sorted(panels - with_data)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 1 if any(row["status"] == "error" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
