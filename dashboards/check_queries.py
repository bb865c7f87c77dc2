#!/usr/bin/env python3
"""Run every query of dashboards/freeflow.json against a real Prometheus.

    python3 dashboards/check_queries.py [http://127.0.0.1:9090] [--rate 1m]

Grafana's variables are replaced as Grafana would with the dashboard's defaults
($__rate_interval by --rate). Each query must be accepted by Prometheus; the report says
how many series each returned (0 is expected for panels of things that did not happen,
such as resyncs or pass-on failures on a quiet cluster). Exit status 1 if any query is
refused.
"""

import json
import pathlib
import sys
import urllib.parse
import urllib.request

DASHBOARD = pathlib.Path(__file__).with_name("freeflow.json")


def queries(rate: str):
    dashboard = json.loads(DASHBOARD.read_text())
    defaults = {v["name"]: v["current"]["value"] for v in dashboard["templating"]["list"] if v["type"] == "custom"}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate)
            for name, value in defaults.items():
                expr = expr.replace(f"${name}", value)
            yield panel["title"], target.get("legendFormat", ""), expr


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    base = args[0] if args else "http://127.0.0.1:9090"
    rate = sys.argv[sys.argv.index("--rate") + 1] if "--rate" in sys.argv else "1m"
    refused = 0
    for title, legend, expr in queries(rate):
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        if body.get("status") != "success":
            refused += 1
            print(f"REFUSED  {title} / {legend}: {body.get('error')}\n         {expr}")
            continue
        series = body["data"]["result"]
        print(f"ok {len(series):3} series  {title} / {legend}")
    print(f"{refused} queries refused")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
