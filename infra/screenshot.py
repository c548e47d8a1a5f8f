#!/usr/bin/env python3
"""PNG screenshots of a pipeline run in the Prefect UI and in the MLflow UI, with headless Chromium.

Give the pages directly:

    python infra/screenshot.py --prefect-url http://127.0.0.1:4200/runs/flow-run/<id> \\
        --mlflow-url 'http://127.0.0.1:5000/#/experiments/1/runs/<run id>' --out screenshots

or let the script find the latest run: the latest started flow run of flow `r1flow-pipeline`
(optionally of one deployment) through the Prefect REST API at PREFECT_API_URL, and the MLflow
parent run of that flow run (tag `r1flow.flow_run_id`; else the latest parent run) through MLflow's
client at MLFLOW_TRACKING_URI. Needs the `chromium` binary (Debian/Ubuntu: `apt-get install
chromium`). Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DEFAULT_FLOW = "r1flow-pipeline"


class ScreenshotError(RuntimeError):
    """A problem the user can fix; reported as one line, exit code 2."""


# ----------------------------------------------------------------------------- Prefect


def prefect_ui_url(api_url: str) -> str:
    """The UI base of a self-hosted server: PREFECT_UI_URL, else the API URL without `/api`."""
    if ui := os.environ.get("PREFECT_UI_URL"):
        return ui.rstrip("/")
    base = api_url.rstrip("/")
    return base[: -len("/api")] if base.endswith("/api") else base


def flow_run_url(ui_url: str, flow_run_id: str) -> str:
    return f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"


def _post_json(url: str, body: dict, timeout: float) -> object:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if key := os.environ.get("PREFECT_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise ScreenshotError(f"{url}: HTTP {exc.code} {exc.read()[:300]!r}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise ScreenshotError(f"cannot reach the Prefect API at {url}: {exc}") from exc


def latest_flow_run(api_url: str, flow_name: str, deployment: str | None, timeout: float = 15) -> dict:
    """The most recently started flow run of `flow_name` (and `deployment`, when given)."""
    body: dict = {
        "flows": {"name": {"any_": [flow_name]}},
        "flow_runs": {"start_time": {"is_null_": False}},
        "sort": "START_TIME_DESC",
        "limit": 1,
    }
    if deployment:
        body["deployments"] = {"name": {"any_": [deployment]}}
    runs = _post_json(f"{api_url.rstrip('/')}/flow_runs/filter", body, timeout)
    if not runs:
        where = f"flow {flow_name!r}" + (f", deployment {deployment!r}" if deployment else "")
        raise ScreenshotError(f"no started flow run of {where} at {api_url}")
    return runs[0]


# ----------------------------------------------------------------------------- MLflow


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def latest_parent_run(tracking_uri: str, flow_run_id: str | None = None) -> tuple[str, str]:
    """(experiment id, run id) of the pipeline's parent run: the one recorded for `flow_run_id`,
    else the latest run tagged `r1flow.recipe` (only parent runs carry that tag)."""
    from mlflow.tracking import MlflowClient  # imported here: `--help` stays fast

    client = MlflowClient(tracking_uri)
    experiments = client.search_experiments(filter_string="name LIKE 'r1flow/%'") or client.search_experiments()
    ids = [e.experiment_id for e in experiments]
    if not ids:
        raise ScreenshotError(f"no experiments at {tracking_uri}")
    parent = "tags.`r1flow.recipe` LIKE '%'"  # stage runs carry r1flow.flow_run_id too, but no recipe tag
    filters = [f"tags.`r1flow.flow_run_id` = '{flow_run_id}' AND {parent}", parent] if flow_run_id else [parent]
    for filter_string in filters:
        runs = client.search_runs(ids, filter_string=filter_string, order_by=["attributes.start_time DESC"],
                                  max_results=1)
        if runs:
            return runs[0].info.experiment_id, runs[0].info.run_id
    raise ScreenshotError(f"no r1flow parent run at {tracking_uri}")


# ----------------------------------------------------------------------------- Chromium


def find_chromium(explicit: str | None = None) -> str:
    candidates = [explicit] if explicit else [os.environ.get("CHROMIUM"), *CHROMIUM_NAMES]
    for name in filter(None, candidates):
        if path := shutil.which(name):
            return path
    tried = explicit or ", ".join(filter(None, candidates))
    raise ScreenshotError(
        f"no Chromium binary found (tried: {tried}); install it (Debian/Ubuntu: `apt-get install chromium`) "
        "or pass --chromium PATH"
    )


def chromium_command(binary: str, url: str, out: Path, window: str, budget_ms: int, profile: Path) -> list[str]:
    return [
        binary,
        "--headless=new",
        "--disable-gpu",
        "--no-sandbox",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={window}",
        f"--virtual-time-budget={budget_ms}",
        f"--screenshot={out}",
        url,
    ]


def shoot(binary: str, url: str, out: Path, window: str, budget_ms: int, timeout: float) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="r1flow-chromium-") as profile:
        cmd = chromium_command(binary, url, out, window, budget_ms, Path(profile))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ScreenshotError(f"chromium did not finish within {timeout:.0f} s for {url}") from exc
    if not out.is_file() or out.stat().st_size == 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise ScreenshotError(f"chromium wrote no screenshot for {url} (exit {proc.returncode}): " + " | ".join(tail))
    return out


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Screenshot a pipeline run in the Prefect UI and the MLflow UI (headless Chromium).",
        epilog="Without --prefect-url/--mlflow-url the latest run is found through PREFECT_API_URL and "
        "MLFLOW_TRACKING_URI.",
    )
    p.add_argument("--prefect-url", help="Prefect UI page of a flow run (…/runs/flow-run/<id>)")
    p.add_argument("--mlflow-url", help="MLflow UI page of a run (…/#/experiments/<id>/runs/<run id>)")
    p.add_argument("--only", choices=("prefect", "mlflow"), help="take just one of the two screenshots")
    p.add_argument("--flow", default=DEFAULT_FLOW, help="flow whose latest run to find (default: %(default)s)")
    p.add_argument("--deployment", help="only runs of this deployment (name without the flow prefix)")
    p.add_argument("--out", type=Path, default=Path("screenshots"), help="output directory (default: %(default)s)")
    p.add_argument("--chromium", help="Chromium binary (default: $CHROMIUM, then chromium, chromium-browser, google-chrome)")
    p.add_argument("--window-size", default="1600,1000", help="WIDTH,HEIGHT (default: %(default)s)")
    p.add_argument("--budget-ms", type=int, default=15000,
                   help="virtual time the page gets to render before the shot (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=90, help="seconds per screenshot (default: %(default)s)")
    return p.parse_args(argv)


def resolve_urls(args: argparse.Namespace) -> dict[str, str]:
    """{'prefect': url, 'mlflow': url} for the screenshots asked for."""
    wanted = [args.only] if args.only else ["prefect", "mlflow"]
    urls: dict[str, str] = {}
    flow_run_id = None
    if "prefect" in wanted:
        if args.prefect_url:
            urls["prefect"] = args.prefect_url
        else:
            api = os.environ.get("PREFECT_API_URL")
            if not api:
                raise ScreenshotError("give --prefect-url or set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)")
            run = latest_flow_run(api, args.flow, args.deployment)
            flow_run_id = run["id"]
            urls["prefect"] = flow_run_url(prefect_ui_url(api), flow_run_id)
    if "mlflow" in wanted:
        if args.mlflow_url:
            urls["mlflow"] = args.mlflow_url
        else:
            tracking = os.environ.get("MLFLOW_TRACKING_URI", "")
            if not tracking.startswith(("http://", "https://")):
                raise ScreenshotError("give --mlflow-url or set MLFLOW_TRACKING_URI to the MLflow server "
                                      "(e.g. http://127.0.0.1:5000)")
            experiment_id, run_id = latest_parent_run(tracking, flow_run_id)
            urls["mlflow"] = mlflow_run_url(tracking, experiment_id, run_id)
    return urls


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        binary = find_chromium(args.chromium)  # before any network call: fail fast when it is missing
        urls = resolve_urls(args)
        names = {"prefect": "prefect-flow-run.png", "mlflow": "mlflow-run.png"}
        for kind, url in urls.items():
            path = shoot(binary, url, args.out / names[kind], args.window_size, args.budget_ms, args.timeout)
            print(f"{kind}: {url}\n  -> {path}")
    except ScreenshotError as exc:
        print(f"screenshot: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
