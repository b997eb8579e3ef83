"""A picture of the dashboard without Grafana: every panel of ``orchestrator.json`` with
Prometheus's own answers to its queries, drawn as HTML and photographed by Chromium.

    python deploy/grafana/preview.py --demo --out docs/img/dashboard.png
    python deploy/grafana/preview.py --prometheus http://127.0.0.1:9090 --minutes 30 --out d.png

``--demo`` sets up what the picture shows: a fresh database on ``--database-url``'s server
(default the local one), two workers and a reconciler of ``demo_app.py`` serving
``--metrics-port``, a Prometheus (Debian's ``prometheus`` package) scraping them every 5 s
with ``deploy/prometheus/alerts.yml`` loaded, and a workload of ``--minutes`` (a burst that
makes a backlog, retries, unknown outcomes settled by a lookup or by an operator, parked
runs, cancellations, failures, and one worker killed with SIGKILL halfway). Then it draws.

The queries are the dashboard's, with ``$workflow`` and ``$tool`` set to all and
``$__rate_interval`` to 30 s; the layout follows each panel's ``gridPos``. It is a preview:
Grafana draws the real thing (``docker compose --profile telemetry up``), with its own
styles.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "orchestrator.json"
ALERTS = HERE.parent / "prometheus" / "alerts.yml"
SCRAPE_SECONDS = 5
RATE_INTERVAL = "30s"
COLOURS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff",
           "#fade2a", "#37872d", "#c4162a"]


def log(text: str) -> None:
    print(f"preview: {text}", file=sys.stderr, flush=True)


# -- asking Prometheus ----------------------------------------------------------------------


def _query(base: str, path: str, **params: Any) -> list[dict[str, Any]]:
    url = f"{base.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {params.get('query')!r}: {body}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _expression(expr: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL)
            .replace('=~"$workflow"', '=~".*"').replace('=~"$tool"', '=~".*"'))


def _legend(fmt: str | None, labels: dict[str, str]) -> str:
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def _number(text: str) -> float | None:
    value = float(text)
    return None if math.isnan(value) or math.isinf(value) else value


def series_of(base: str, panel: dict[str, Any], start: float, end: float, step: float
              ) -> list[tuple[str, list[tuple[float, float | None]]]]:
    out = []
    for target in panel.get("targets", []):
        rows = _query(base, "query_range", query=_expression(target["expr"]), start=start,
                      end=end, step=step)
        for row in rows:
            points = [(float(t), _number(v)) for t, v in row["values"]]
            out.append((_legend(target.get("legendFormat"), row["metric"]), points))
    return out


def stat_of(base: str, panel: dict[str, Any], at: float) -> float | None:
    for target in panel.get("targets", []):
        rows = _query(base, "query", query=_expression(target["expr"]), time=at)
        if rows:
            return _number(rows[0]["value"][1])
    return None


# -- drawing --------------------------------------------------------------------------------


def fmt(value: float | None, unit: str | None) -> str:
    if value is None:
        return "–"
    if unit == "s":
        if value == 0:
            return "0 s"
        if value < 1:
            return f"{value * 1000:.3g} ms"
        if value < 120:
            return f"{value:.3g} s"
        if value < 7200:
            return f"{value / 60:.3g} min"
        return f"{value / 3600:.3g} h"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    suffix = " /s" if unit == "ops" else ""
    for size, letter in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= size:
            return f"{value / size:.3g}{letter}{suffix}"
    return f"{value:.3g}{suffix}" if value else f"0{suffix}"


def _svg(series: list[tuple[str, list[tuple[float, float | None]]]], unit: str | None,
         start: float, end: float, width: int, height: int) -> str:
    left, right, top, bottom = 58, 8, 8, 20
    values = [v for _, points in series for _, v in points if v is not None]
    high = max(values, default=1.0)
    high = high * 1.1 if high > 0 else 1.0
    w, h = width - left - right, height - top - bottom

    def x(t: float) -> float:
        return left + (t - start) / (end - start) * w

    def y(v: float) -> float:
        return top + h - v / high * h

    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">']
    for i in range(4):
        v = high * i / 3
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     'stroke="#2c3235"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">'
                     f'{html.escape(fmt(v, unit))}</text>')
    for i in range(5):
        t = start + (end - start) * i / 4
        label = datetime.fromtimestamp(t, UTC).strftime("%H:%M")
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"
        parts.append(f'<text x="{x(t):.1f}" y="{height - 4}" text-anchor="{anchor}">{label}'
                     '</text>')
    for n, (_, points) in enumerate(series):
        colour = COLOURS[n % len(COLOURS)]
        runs: list[list[str]] = [[]]
        for t, v in points:
            if v is None:
                runs.append([])
            else:
                runs[-1].append(f"{x(t):.1f},{y(v):.1f}")
        for run in runs:
            if len(run) > 1:
                parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                             f'points="{" ".join(run)}"/>')
            elif run:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{colour}"/>')
    parts.append("</svg>")
    return "".join(parts)


def _legend_table(series: list[tuple[str, list[tuple[float, float | None]]]],
                  unit: str | None) -> str:
    rows = ['<table class="legend"><tr><th></th><th>last</th><th>max</th></tr>']
    for n, (name, points) in enumerate(series):
        values = [v for _, v in points if v is not None]
        last = values[-1] if values else None
        rows.append(f'<tr><td><i style="background:{COLOURS[n % len(COLOURS)]}"></i>'
                    f'{html.escape(name)}</td><td>{html.escape(fmt(last, unit))}</td>'
                    f'<td>{html.escape(fmt(max(values, default=None), unit))}</td></tr>')
    rows.append("</table>")
    return "".join(rows)


CSS = """
body { margin: 0; background: #111217; color: #ccccdc; font: 12px Inter, Helvetica, Arial,
       sans-serif; }
header { padding: 10px 16px 4px; }
header h1 { font-size: 18px; margin: 0; color: #fff; font-weight: 500; }
header p { margin: 4px 0 0; color: #8e8e98; }
.grid { position: relative; margin: 8px; }
.panel { position: absolute; box-sizing: border-box; background: #181b1f;
         border: 1px solid #2c3235; border-radius: 2px; padding: 6px 8px; overflow: hidden; }
.panel h2 { font-size: 12px; margin: 0 0 4px; color: #ccccdc; font-weight: 500; }
.row { position: absolute; font-size: 14px; color: #fff; font-weight: 500; padding-top: 8px; }
.stat { font-size: 38px; font-weight: 500; margin-top: 12px; }
.body { display: flex; gap: 6px; }
.body.below { flex-direction: column; }
svg text { fill: #8e8e98; font-size: 10px; }
table.legend { border-collapse: collapse; font-size: 11px; align-self: flex-start; }
table.legend th { color: #8e8e98; font-weight: 400; text-align: right; padding: 0 4px; }
table.legend td { padding: 1px 4px; text-align: right; white-space: nowrap; }
table.legend td:first-child { text-align: left; max-width: 190px; overflow: hidden;
                              text-overflow: ellipsis; }
table.legend i { display: inline-block; width: 12px; height: 3px; margin: 0 5px 3px 0;
                 vertical-align: middle; }
"""


def render_html(base: str, start: float, end: float, width: int = 1600) -> str:
    dashboard = json.loads(DASHBOARD.read_text())
    unit_w, unit_h, gap = (width - 16) / 24, 30, 6
    step = max(SCRAPE_SECONDS, (end - start) / 240)
    blocks, bottom = [], 0
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        left, top = pos["x"] * unit_w, pos["y"] * unit_h
        w, h = pos["w"] * unit_w - gap, pos["h"] * unit_h - gap
        bottom = max(bottom, top + h)
        title = html.escape(panel["title"])
        if panel["type"] == "row":
            blocks.append(f'<div class="row" style="left:{left}px;top:{top}px">{title}</div>')
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        box = f'left:{left:.0f}px;top:{top:.0f}px;width:{w:.0f}px;height:{h:.0f}px'
        if panel["type"] == "stat":
            value = stat_of(base, panel, end)
            calm = not value or panel["title"] == "Database up"
            colour = COLOURS[0] if calm else COLOURS[1]
            shown = "No data" if value is None else fmt(value, unit)
            blocks.append(f'<div class="panel" style="{box}"><h2>{title}</h2><div class="stat" '
                          f'style="color:{colour}">{shown}</div></div>')
            continue
        series = series_of(base, panel, start, end, step)
        below = pos["w"] < 12
        legend_w = 0 if below else 250
        chart_h = int(h - 30 - (15 * min(len(series) + 1, 5) if below else 0))
        svg = _svg(series, unit, start, end, int(w - 18 - legend_w), max(chart_h, 60))
        blocks.append(f'<div class="panel" style="{box}"><h2>{title}</h2>'
                      f'<div class="body{" below" if below else ""}">{svg}'
                      f'{_legend_table(series, unit)}</div></div>')
    when = datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%d %H:%M UTC")
    minutes = round((end - start) / 60)
    return (f"<!doctype html><html><head><meta charset='utf-8'><style>{CSS}</style></head>"
            f"<body><header><h1>{html.escape(dashboard['title'])}</h1><p>Preview of "
            f"deploy/grafana/orchestrator.json: each panel's query answered by Prometheus, "
            f"the last {minutes} minutes to {when}; drawn by deploy/grafana/preview.py, not "
            f"by Grafana.</p></header><div class='grid' style='height:{bottom + 8:.0f}px'>"
            f"{''.join(blocks)}</div></body></html>")


def photograph(page_html: str, out: Path, chromium: str, width: int = 1600) -> None:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "dashboard.html"
        page_file.write_text(page_html)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.goto(page_file.as_uri())
            page.screenshot(path=str(out), full_page=True)
            browser.close()


# -- the demo -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_http(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


class Demo:
    """The processes of ``--demo``, stopped by :meth:`close`."""

    def __init__(self, admin_url: str, tmp: Path) -> None:
        import psycopg  # noqa: TID251 - a tool beside the package: it creates a database

        self.tmp = tmp
        name = "orchestrator_dashboard_preview"
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
        parts = urllib.parse.urlsplit(admin_url)
        self.url = urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))
        self.env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": self.url,
                    "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", "orchestrator", "db", "upgrade"], env=self.env,
                       check=True, capture_output=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports = {"worker-1": _free_port(), "worker-2": _free_port(),
                      "reconciler": _free_port()}
        for name in ("worker-1", "worker-2", "reconciler"):
            self.start(name)
        self.prometheus_port = _free_port()
        self._start_prometheus()

    def start(self, name: str) -> None:
        kind = "reconciler" if name == "reconciler" else "worker"
        args = [sys.executable, "-m", "orchestrator", kind, "--app", "demo_app:app",
                "--metrics-port", str(self.ports[name])]
        if kind == "worker":
            args += ["--concurrency", "16", "--lease-ttl", "10"]
        self.procs[name] = subprocess.Popen(args, env=self.env, stdout=subprocess.DEVNULL,
                                            stderr=open(self.tmp / f"{name}.log", "ab"))  # noqa: SIM115
        _wait_http(f"http://127.0.0.1:{self.ports[name]}/healthz")

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def _start_prometheus(self) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("preview: --demo needs Prometheus (apt-get install prometheus)")
        shutil.copy(ALERTS, self.tmp / "alerts.yml")
        workers = ", ".join(f'"127.0.0.1:{port}"' for name, port in self.ports.items()
                            if name.startswith("worker"))
        # The job names of deploy/prometheus/prometheus.yml, which the alert rules name.
        (self.tmp / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {SCRAPE_SECONDS}s\n"
            f"  evaluation_interval: {SCRAPE_SECONDS}s\n"
            "rule_files: [alerts.yml]\n"
            "scrape_configs:\n"
            f"  - job_name: orchestrator-workers\n"
            f"    static_configs:\n      - targets: [{workers}]\n"
            f"  - job_name: orchestrator-reconciler\n"
            f"    static_configs:\n"
            f"      - targets: [\"127.0.0.1:{self.ports['reconciler']}\"]\n")
        self.procs["prometheus"] = subprocess.Popen(
            [binary, f"--config.file={self.tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.prometheus_port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.tmp / "prometheus.log", "ab"))  # noqa: SIM115
        _wait_http(f"{self.prometheus}/-/ready")

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def workload(demo: Demo, minutes: float) -> None:
    """Submit, cancel and settle for ``minutes``, saying so once a minute."""
    sys.path.insert(0, str(HERE))
    import demo_app

    app = demo_app.app
    rng = random.Random(7)
    began = time.monotonic()
    total = minutes * 60
    killed = burst = False
    order = 0
    said = -1
    while (elapsed := time.monotonic() - began) < total:
        if int(elapsed // 60) != said:
            said = int(elapsed // 60)
            log(f"workload: minute {said + 1} of {math.ceil(minutes)}")
        rate = 6 + 5 * math.sin(elapsed / 45)
        for _ in range(rng.randint(int(rate), int(rate) + 2)):
            order += 1
            await app.submit_async("checkout", {"sku": f"sku-{order % 40}",
                                                "declined": rng.random() < 0.03})
        if rng.random() < 0.6:
            order += 1
            await app.submit_async("fulfil", {"order": order, "pause": rng.uniform(1, 6)})
        if rng.random() < 0.25:
            order += 1
            await app.submit_async("give_back", {"order": order})
        if rng.random() < 0.08:
            handle = await app.submit_async("nightly_report", {"seconds": 20})
            if rng.random() < 0.6:
                asyncio.get_running_loop().call_later(
                    3, lambda h=handle: asyncio.ensure_future(app.cancel_async(h.id)))
        if not burst and elapsed > total * 0.3:
            burst = True
            log("workload: a burst of 1,500 checkouts")
            for _ in range(1500):
                order += 1
                await app.submit_async("checkout", {"sku": f"sku-{order % 40}"})
        if not killed and elapsed > total * 0.55:
            killed = True
            log("workload: worker-1 killed (SIGKILL), started again")
            demo.kill("worker-1")
            demo.start("worker-1")
        if int(elapsed) % 75 == 74:
            await settle(app)
        await asyncio.sleep(1)


async def settle(app: Any) -> None:
    """An operator settles the older half of what waits for one."""
    items = await app.operators.list_items(operator="preview", state="operator")
    for item in items[: (len(items) + 1) // 2]:
        await app.operators.resolve_committed(
            item["operation_id"], receipt={"refund": "confirmed"},
            evidence="the bank's statement shows the refund", operator="preview")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--prometheus", help="draw from this Prometheus (no --demo)")
    parser.add_argument("--demo", action="store_true", help="run the demo workload first")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="the workload's length (--demo) or the range drawn")
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="--demo: a server where a fresh database may be created")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--html", type=Path, help="also write the page here")
    args = parser.parse_args()
    if args.demo == bool(args.prometheus):
        parser.error("give either --demo or --prometheus URL")
    demo = None
    tmp = Path(tempfile.mkdtemp(prefix="dashboard-preview-"))
    try:
        if args.demo:
            demo = Demo(args.database_url, tmp)
            os.environ["ORCHESTRATOR_DATABASE_URL"] = demo.url
            asyncio.run(workload(demo, args.minutes))
            time.sleep(2 * SCRAPE_SECONDS)
            base = demo.prometheus
        else:
            base = args.prometheus
        end = time.time()
        start = end - timedelta(minutes=args.minutes).total_seconds()
        page = render_html(base, start, end)
        if args.html:
            args.html.write_text(page)
        photograph(page, args.out, args.chromium)
        log(f"wrote {args.out}")
    finally:
        if demo is not None:
            demo.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
