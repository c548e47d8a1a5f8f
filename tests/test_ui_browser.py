"""Issue 44's UI items, checked in a real browser (headless Chromium driven over the DevTools protocol) against
servers started the way users start them: `r1flow up`, a tiny `r1flow run`, `r1flow down`, `r1flow up` again, then
the pages a user opens from what those commands printed.

- item 1: the report's links and plots still open after `down; up` (the Prefect artifact page of the report);
- item 6: the experiment link `r1flow up` prints opens MLflow's runs table (not the GenAI overview) with the run
  names readable, the run link `r1flow run` prints opens the run in the model-training view, and the report's
  MLflow column is on screen in both UIs' report panes at 1280 px;
- item 3: the eval stage's run form, served by `r1flow serve --recipe sft-eval`, filled in and submitted in Prefect's
  UI with `node` left blank and a model that sft-eval's `sft` made, runs as eval_sft (test_deploy.py's
  test_a_blank_node_in_the_stage_form_is_named_after_the_model_it_evaluates checks the same through the flow
  function, without the form).

Issue 59 item 6: the flow run's page draws the recipe's DAG (test_flow.py's test_the_run_graph_is_the_recipes_dag
checks the task runs' recorded inputs through the API, in order and with --parallel). Item 9: the report's location
`r1flow run` prints opens it, its registry links open the model versions in MLflow's model-training view, every
report table fits Prefect's artifact pane, and the runs table shows each run's profile.

Skipped without Chromium (R1FLOW_CHROMIUM names the binary; else `chromium`, `chromium-browser`, `google-chrome`
on PATH) or without the `websockets` package. One module fixture starts the servers; 2.5 min on 2 cores shared
at load 7 (the serve test ~65 s of it), 4 min at load 12."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flows.servers import servers
from tests.conftest import clean_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
R1FLOW = [sys.executable, "-m", "flows.cli"]
CHROMIUM = os.environ.get("R1FLOW_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
# Debian's chromium: no sandbox as root, no GPU; the background-networking flags keep it off the (closed) network
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--window-size=1280,800", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0"]
LINK = re.compile(r"http://127\.0\.0\.1:\d+/#/experiments/\S+")


# ---------------------------------------------------------------------------- a browser over the DevTools protocol
class Browser:
    """One headless Chromium (fresh profile: no stored UI choices) and its first tab."""

    def __init__(self, binary: str):
        from websockets.sync.client import connect

        self.profile = Path(tempfile.mkdtemp(prefix="r1flow-chromium-"))
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = self.profile / "DevToolsActivePort"  # Chromium writes the port it took here
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"{binary} did not start (exit code {self.proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self.ids = itertools.count(1)
        self.events: list[dict] = []  # the events of enabled domains (Network), read as calls go

    def call(self, method: str, **params) -> dict:
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:  # events in between are kept in self.events
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            if "method" in msg:
                self.events.append(msg)

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:200]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str) -> None:
        """Load url afresh (through about:blank: a hash change in the same app would keep the old page's DOM
        until the app re-renders, and a wait could read the old page)."""
        self.call("Page.navigate", url="about:blank")
        self.wait("location.href === 'about:blank' && document.readyState === 'complete'", timeout=10)
        self.call("Page.navigate", url=url)

    def wait(self, expression: str, timeout: float = 60, what: str = ""):
        """The value of expression once truthy (polled); an AssertionError with a screenshot's path at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                shot = self.screenshot()
                raise AssertionError(f"{what or expression} not within {timeout} s at {self.js('location.href')} "
                                     f"(screenshot {shot}); the page says:\n{self.text()[:1500]}")
            time.sleep(0.25)

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def fetched_json(self, url_part: str, timeout: float = 60):
        """The JSON the page fetched from the first URL containing `url_part` since `Network.enable`."""
        deadline = time.monotonic() + timeout
        while True:
            request = next((e["params"]["requestId"] for e in self.events if e["method"] == "Network.responseReceived"
                            and url_part in e["params"]["response"]["url"]), None)
            if request and any(e["method"] == "Network.loadingFinished" and e["params"]["requestId"] == request
                               for e in self.events):
                body = self.call("Network.getResponseBody", requestId=request)
                return json.loads(base64.b64decode(body["body"]) if body["base64Encoded"] else body["body"])
            if time.monotonic() > deadline:
                raise AssertionError(f"the page fetched no {url_part} within {timeout} s (screenshot {self.screenshot()})")
            self.js("0")  # reads the events that came meanwhile
            time.sleep(0.25)

    def screenshot(self) -> Path:
        path = Path(tempfile.mkstemp(prefix="r1flow-ui-", suffix=".png")[1])
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "ws", None) is not None:
                self.ws.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            shutil.rmtree(self.profile, ignore_errors=True)


# JS: is this element inside the viewport and inside every box that clips it (overflow other than visible)?
ON_SCREEN = """(e => { const r = e.getBoundingClientRect(); let left = 0, right = innerWidth;
  for (let p = e.parentElement; p; p = p.parentElement) {
    if (getComputedStyle(p).overflowX !== 'visible') {
      const q = p.getBoundingClientRect(); left = Math.max(left, q.left); right = Math.min(right, q.right); } }
  return r.width > 0 && r.left >= left - 0.5 && r.right <= right + 0.5; })"""

# JS: the characters of an element's text that are on screen: those left of the right edge of every box that clips
# it (overflow other than visible; the name cell's `text-overflow: ellipsis` box is one), less the ellipsis when cut
VISIBLE_TEXT = """(e => { let right = innerWidth;
  for (let p = e; p; p = p.parentElement)
    if (getComputedStyle(p).overflowX !== 'visible') right = Math.min(right, p.getBoundingClientRect().right);
  const chars = [], walker = document.createTreeWalker(e, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode())
    for (let i = 0; i < n.length; i++) {
      const range = document.createRange(); range.setStart(n, i); range.setEnd(n, i + 1);
      chars.push([n.data[i], range.getBoundingClientRect().right]); }
  if (chars.every(([, r]) => r <= right + 0.5)) return chars.map(([c]) => c).join('');
  right -= 12;  // the ellipsis
  let out = ''; for (const [c, r] of chars) { if (r > right) break; out += c; } return out; })"""


def _report_column_on_screen(browser: Browser, header: str = "MLflow run") -> dict | None:
    """Where the report's stage table puts its MLflow column: the header cell and every link under it on screen?
    (Prefect renders the markdown table as a <table>; MLflow as ARIA rows and cells.)"""
    return browser.js(f"""(() => {{
      const on = {ON_SCREEN}, CELL = 'th, td, [role=columnheader], [role=cell]';
      const th = [...document.querySelectorAll('th, [role=columnheader]')].find(t => t.innerText.trim() === {json.dumps(header)});
      if (!th) return null;
      const headerRow = th.closest('tr, [role=row]'), table = th.closest('table, [role=table]');
      const col = [...headerRow.children].filter(c => c.matches(CELL)).indexOf(th);
      const cells = [...table.querySelectorAll('tr, [role=row]')].filter(r => r !== headerRow)
        .map(r => [...r.children].filter(c => c.matches(CELL))[col]).filter(Boolean);
      const r = th.getBoundingClientRect();
      return {{header: on(th), cells: cells.length, cells_on: cells.filter(on).length,
               links: cells.filter(c => c.querySelector('a[href*="/runs/"]')).length,
               left: r.left, right: r.right, width: innerWidth}};
    }})()""")


# ---------------------------------------------------------------------------- the servers, as a user meets them
def _r1flow(args: list[str], env: dict[str, str], timeout: float = 300) -> str:
    out = subprocess.run([*R1FLOW, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"r1flow {' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _get_json(url: str, data: dict | None = None):
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """`r1flow up`; a tiny eval run; `r1flow down`; `r1flow up`: what each printed, the run, and a browser."""
    if CHROMIUM is None:
        pytest.skip("no Chromium (install Debian's `chromium`, or set R1FLOW_CHROMIUM)")
    pytest.importorskip("websockets.sync.client", reason="the DevTools client needs the websockets package")
    home = tmp_path_factory.mktemp("ui-home") / "home"
    env = clean_env(home)
    state: dict = {"home": home, "env": env}
    try:
        state["first_up"] = _r1flow(["up", "--detach"], env, timeout=240)
        first = servers.status(home)
        state["run_out"] = _r1flow(["run", "--recipe", "eval", "--profile", "tiny", "--set",
                                    "eval_base.max_prompts=4", "--json", str(home / "run.json")], env, timeout=600)
        state["run"] = json.loads((home / "run.json").read_text())
        _r1flow(["down"], env, timeout=120)
        state["up"] = _r1flow(["up", "--detach"], env, timeout=240)
        info = state["info"] = servers.status(home)
        state["ports_kept"] = (first.prefect.port, first.mlflow.port) == (info.prefect.port, info.mlflow.port)
        browser = state["browser"] = Browser(CHROMIUM)
        try:
            yield state
        finally:
            browser.close()
    finally:
        servers.stop(home)


def _run_name(info, run_id: str) -> str:
    return _get_json(f"{info.mlflow.url}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]["info"]["run_name"]


def _in_model_training_view(experiment_id: str) -> str:
    """JS: MLflow's sidebar is the model-training one (a Runs entry for this experiment, no GenAI Evaluations)."""
    return (f"[...document.querySelectorAll('a')].some(a => a.innerText.trim() === 'Runs' && "
            f"(a.getAttribute('href') || '').startsWith('#/experiments/{experiment_id}/runs')) && "
            "![...document.querySelectorAll('a')].some(a => (a.getAttribute('href') || '').includes('evaluation-runs'))")


def _report_artifact_id(info, flow_run_id: str) -> str:
    found = _get_json(f"{info.prefect_api_url}/artifacts/filter",
                      {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["r1flow-report-eval"]}}})
    assert len(found) == 1, found
    return found[0]["id"]


# ---------------------------------------------------------------------------- item 1
def test_report_plots_and_links_open_after_down_and_up(ui):
    """The run's report, opened in Prefect's UI after `r1flow down; r1flow up`: its plot loads (from MLflow's
    get-artifact route) and every MLflow link in it opens the run it names. Before issue 44 each `up` took new
    ports, so after `down; up` the image was broken and the links went to a port where nothing listened."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    assert ui["ports_kept"], "r1flow up took other ports after down"
    browser.open(f"{info.prefect.url}/artifacts/artifact/{_report_artifact_id(info, run['flow_run_id'])}")
    browser.wait("document.body && document.body.innerText.includes('MLflow parent run')", what="the report")
    images = browser.wait("""(() => { const imgs = [...document.images].filter(i => i.src.includes('get-artifact'));
        return imgs.length && imgs.every(i => i.complete) && imgs.map(i => [i.src, i.naturalWidth]); })()""",
                          what="the report's plots")
    assert all(src.startswith(f"{info.mlflow.url}/get-artifact?") and width > 0 for src, width in images), images
    links = browser.js("[...document.querySelectorAll('a')].map(a => a.href).filter(h => h.includes('/#/experiments/'))")
    run_ids = {m.group(1) for h in links if (m := re.search(r"/runs/([0-9a-f]{32})", h))}
    assert run["parent_run_id"] in run_ids and len(run_ids) == 1 + len(run["stages"]), links
    assert all(h.startswith(f"{info.mlflow.url}/") for h in links), links
    for href in dict.fromkeys(links):  # as a click opens it: the run's own page, its name in the header
        run_id = re.search(r"/runs/([0-9a-f]{32})", href).group(1)
        name = _run_name(info, run_id)
        browser.open(href)
        browser.wait(f"document.body && document.body.innerText.includes({json.dumps(name)}) && "
                     f"document.body.innerText.includes({json.dumps(run_id)})", what=f"run {name} from {href}")


# ---------------------------------------------------------------------------- item 6
def test_the_experiment_link_up_prints_opens_the_runs_table_with_readable_run_names(ui):
    """The link `r1flow up` prints for the experiment (`  r1flow/eval: <url>`) opens MLflow's runs table, in a
    browser that never chose a view, and the parent run's name shows its time (what tells a recipe's runs apart)
    before the column cuts it. Before issue 44 up printed the experiments list, whose links open an experiment on
    MLflow 3's GenAI overview (#/experiments/<id> redirects to /overview/usage?workflowType=genai); parent runs were
    named `<recipe> <profile> <time> <id>`, which the ~20-character column cut in the middle of the time (and
    `<time> <recipe> <profile> <id>` after that lost the id: `11-27 15:17 eval tin…`); before issue 59,
    `<time> <id> <recipe> <profile>` lost the profile (`11-27 15:17 b2905c…`): now `<time> <profile> <id> <recipe>`."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    printed = [line.strip() for line in ui["up"].splitlines() if line.strip().startswith("r1flow/eval: ")]
    assert len(printed) == 1, ui["up"]
    url = printed[0].split(": ", 1)[1]
    exp = run["experiment_id"]
    assert url == f"{info.mlflow.url}/#/experiments/{exp}/runs?workflowType=machine_learning", url
    name = _run_name(info, run["parent_run_id"])
    browser.open(url)
    cell = browser.wait(f"""(() => {{ const a = [...document.querySelectorAll('a')].find(a =>
        a.textContent.trim() === {json.dumps(name)} && (a.getAttribute('href') || '').includes('{run["parent_run_id"]}'));
        return a ? ({VISIBLE_TEXT})(a) : null; }})()""", what=f"the runs table's row for {name}")
    hash_ = browser.js("location.hash")
    assert hash_.startswith(f"#/experiments/{exp}/runs?") and "workflowType=machine_learning" in hash_, hash_
    assert "Run Name" in browser.text() and browser.js(_in_model_training_view(exp))
    started = _get_json(f"{info.mlflow.url}/api/2.0/mlflow/runs/get?run_id={run['parent_run_id']}")["run"]["info"]
    when = datetime.fromtimestamp(int(started["start_time"]) / 1000, UTC)
    # the name's minute is the run's start minute, or the one before (the name is made just before the run starts)
    shown_time = re.match(r"\d\d-\d\d \d\d:\d\d", cell)
    assert shown_time, f"the runs table shows {cell!r} of {name!r}"
    assert shown_time.group(0) in {f"{when:%m-%d %H:%M}", f"{datetime.fromtimestamp(when.timestamp() - 60, UTC):%m-%d %H:%M}"}
    # then the profile and the start of the flow run's short id, which tells apart two runs started in the same minute
    # (the recipe is the experiment's name); issue 59: `11-27 15:17 b2905c eval tiny` showed no profile
    assert cell.startswith(f"{shown_time.group(0)} tiny {run['flow_run_id'][:2]}"), \
        f"the runs table shows {cell!r} of {name!r}"


def test_the_run_link_run_prints_opens_the_run_in_the_model_training_view(ui):
    """The parent run's URL `r1flow run` prints last opens that run with MLflow's model-training sidebar (Runs).
    Before issue 44 MlflowClient also printed its own `View run` links without workflowType, which open the run
    under GenAI's Evaluations (the sidebar of traces, judges, evaluation runs)."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    links = LINK.findall(ui["run_out"])
    # the report's page (issue 59) and the run's: MLflow's own `View run` lines are silenced
    assert links == [run["report"]["url"], run["link"]], ui["run_out"][-1500:]
    assert "workflowType=machine_learning" in run["link"]
    name = _run_name(info, run["parent_run_id"])
    browser.open(run["link"])
    browser.wait(f"document.body && document.body.innerText.includes({json.dumps(name)})", what=f"run {name}")
    browser.wait(_in_model_training_view(run["experiment_id"]), timeout=20, what="the model-training sidebar")
    # the check tells the views apart: the same run without workflowType (MLflow's own links) opens under GenAI
    browser.open(run["link"].split("?", 1)[0])
    browser.wait(f"document.body && document.body.innerText.includes({json.dumps(name)}) && "
                 "[...document.querySelectorAll('a')].some(a => (a.getAttribute('href') || '').includes('evaluation-runs'))",
                 what="(control) the GenAI sidebar for a link without workflowType")
    assert not browser.js(_in_model_training_view(run["experiment_id"]))


def test_the_reports_mlflow_column_is_on_screen_in_both_uis(ui):
    """The report's stage table at a 1280 px window, in Prefect's artifact page and in MLflow's artifact view of
    report/report.md: the `MLflow run` column (header and each stage's link) is on screen without scrolling. Before
    issue 44 it was the last column, right of the key-metrics cell, and a table of 1269 px in an 868 px pane put
    it off-screen."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    for where, url in (("Prefect", f"{info.prefect.url}/artifacts/artifact/"
                                   f"{_report_artifact_id(info, run['flow_run_id'])}"),
                       ("MLflow", f"{info.mlflow.url}/#/experiments/{run['experiment_id']}/runs/"
                                  f"{run['parent_run_id']}/artifacts/report/report.md")):
        browser.open(url)
        browser.wait("[...document.querySelectorAll('th, [role=columnheader]')]"
                     ".some(t => t.innerText.trim() === 'MLflow run')", what=f"the report's stage table in {where}'s UI")
        time.sleep(0.5)  # layout settles (images above the table)
        column = _report_column_on_screen(browser)
        assert column["links"] == column["cells"] == len(run["stages"]), (where, column)
        assert column["header"] and column["cells_on"] == column["cells"], (where, column, browser.screenshot())


# ---------------------------------------------------------------------------- item 3
@contextlib.contextmanager
def _serving(env: dict[str, str], log: Path, *args: str):
    proc = subprocess.Popen([*R1FLOW, "serve", *args], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def test_the_stage_form_with_node_left_blank_runs_the_node_the_model_fits(ui):
    """`r1flow serve --recipe sft-eval --stage eval`; in Prefect's UI the eval-served deployment's Run form, filled in
    as a user does (the model sft-eval's `sft` node made, the prompts, max_prompts 2; node left blank, recipe and
    profile as shown) and submitted: the flow run (node null, what the form sends) runs as eval_sft (MLflow stage
    run, its stage-eval-sft artifact). Before issue 44 a blank node was the recipe's first eval node, eval_base:
    the sft model's results were filed under the base model's eval."""
    info, browser, home, env = ui["info"], ui["browser"], ui["home"], ui["env"]
    with _serving(env, home / "serve.log", "--recipe", "sft-eval", "--stage", "eval", "--profile", "tiny") as serve:
        _r1flow(["run", "--recipe", "sft-eval", "--profile", "tiny", "--only", "sft", "--set", "sft.max_steps=2",
                 "--json", str(home / "sft.json")], env, timeout=600)
        outputs = {s["node"]: s["outputs"] for s in json.loads((home / "sft.json").read_text())["stages"]}
        deadline = time.monotonic() + 180
        while not (found := _get_json(f"{info.prefect_api_url}/deployments/filter",
                                      {"deployments": {"name": {"any_": ["eval-served"]}}})):
            assert serve.poll() is None and time.monotonic() < deadline, (home / "serve.log").read_text()[-3000:]
            time.sleep(1)
        deployment = found[0]
        assert deployment["parameters"]["recipe"] == "sft-eval" and "node" not in deployment["parameters"]

        browser.open(f"{info.prefect.url}/deployments/deployment/{deployment['id']}/run")
        browser.wait("document.querySelectorAll('textarea').length >= 2 && "
                     "[...document.querySelectorAll('button')].some(b => b.innerText.trim() === 'Submit')",
                     what="the deployment's run form")
        time.sleep(0.5)
        filled = browser.js(f"""(() => {{
          const set = (e, v) => {{ e.focus(); e.value = v; e.dispatchEvent(new Event('input', {{bubbles: true}}));
                                   e.dispatchEvent(new Event('change', {{bubbles: true}})); e.blur(); }};
          const [model, prompts] = document.querySelectorAll('textarea');  // inputs: Model, Prompts, (Scorer)
          set(model, {json.dumps(outputs["sft"]["model"][:12])}); set(prompts, {json.dumps(outputs["prompts"]["prompts"][:12])});
          const max = document.querySelector('input[type=number]');  // config's first number: Max Prompts
          set(max, '2');
          return [model.value, prompts.value, max.value]; }})()""")
        assert filled == [outputs["sft"]["model"][:12], outputs["prompts"]["prompts"][:12], "2"], filled
        time.sleep(0.5)
        browser.js("[...document.querySelectorAll('button')].find(b => b.innerText.trim() === 'Submit').click()")
        browser.wait("!location.pathname.endsWith('/run')", timeout=30, what="the form submitted")

        deadline = time.monotonic() + 300
        while True:
            runs = _get_json(f"{info.prefect_api_url}/flow_runs/filter",
                             {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}})
            assert len(runs) == 1, runs
            flow_run = runs[0]
            if flow_run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            assert time.monotonic() < deadline and serve.poll() is None, (home / "serve.log").read_text()[-3000:]
            time.sleep(1)
    assert flow_run["state"]["type"] == "COMPLETED", (flow_run["state"], (home / "serve.log").read_text()[-3000:])
    params = flow_run["parameters"]
    assert params.get("node") is None and params["recipe"] == "sft-eval" and params["config"]["max_prompts"] == 2
    exp = _get_json(f"{info.mlflow.url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=r1flow/sft-eval")
    stage_runs = _get_json(f"{info.mlflow.url}/api/2.0/mlflow/runs/search", {
        "experiment_ids": [exp["experiment"]["experiment_id"]],
        "filter": f"tags.`r1flow.flow_run_id` = '{flow_run['id']}'"})["runs"]
    tags = [{t["key"]: t["value"] for t in r["data"]["tags"]} for r in stage_runs]
    stage_runs = [r for r, t in zip(stage_runs, tags, strict=True) if "mlflow.parentRunId" in t]  # not the parent
    nodes = [t.get("r1flow.node") for t in tags if "mlflow.parentRunId" in t]
    assert nodes == ["eval_sft"], nodes
    assert stage_runs[0]["info"]["run_name"] == "eval_sft"
    keys = [a["key"] for a in _get_json(f"{info.prefect_api_url}/artifacts/filter",
                                         {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})]
    assert [k for k in keys if k] == ["stage-eval-sft"], keys  # (keyless: Prefect's own, e.g. the result's)


# ---------------------------------------------------------------------------- issue 59 item 6
def test_the_flow_run_page_draws_the_recipes_dag(ui):
    """The eval run's page in Prefect's UI (the link a user follows from the flow run list): the run graph it draws
    (on a canvas, from the graph-v2 response it fetches, read here over the DevTools protocol) has the recipe's
    edges, base -> eval_base and prompts -> eval_base, and no other. Before issue 59 no stage task recorded the
    nodes it read (their inputs are fingerprints), and Prefect's id() look-up of earlier results drew whatever
    edge a shared object (the empty string in a result and in a config) made up."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    browser.events.clear()
    browser.call("Network.enable")
    try:
        browser.open(f"{info.prefect.url}/runs/flow-run/{run['flow_run_id']}")
        graph = browser.fetched_json(f"/flow_runs/{run['flow_run_id']}/graph-v2")
    finally:
        browser.call("Network.disable")
        browser.events.clear()
    names = {node_id: node["label"] for node_id, node in graph["nodes"]}
    drawn = {node["label"]: {names[p["id"]] for p in node["parents"]} for _, node in graph["nodes"]}
    assert drawn == {"base": set(), "prompts": set(), "eval_base": {"base", "prompts"}}, drawn
    browser.wait("!!document.querySelector('canvas')", what="the run graph's canvas")


# ---------------------------------------------------------------------------- issue 59 item 9
# JS: every table on the page: its header, its width, and whether it fits inside every box that clips it
TABLES_FIT = f"""[...document.querySelectorAll('table')].map(t => ({{
  header: [...t.rows[0].cells].map(c => c.innerText.trim()).join(' | '), width: t.getBoundingClientRect().width,
  fits: ({ON_SCREEN})(t) }}))"""


def _tables_fit(browser: Browser, url: str, first_header: str) -> list[dict]:
    browser.open(url)
    browser.wait(f"[...document.querySelectorAll('th')].some(t => t.innerText.trim() === {json.dumps(first_header)})",
                 what=f"the report's tables at {url}")
    time.sleep(0.5)  # layout settles (images above the tables)
    return browser.js(TABLES_FIT)


def test_the_report_location_run_prints_opens_the_report(ui):
    """With servers up, `r1flow run` prints where the report is as a URL that opens it: the MLflow UI's Artifacts
    tab of the parent run, report.md shown, in the model-training view. Before issue 59 it printed the artifact's
    `mlflow-artifacts:/...` URI, which no browser or shell opens."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    lines = ui["run_out"].splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("report ("))
    url = lines[at + 1].strip()
    assert url.startswith(f"{info.mlflow.url}/#/experiments/{run['experiment_id']}/runs/{run['parent_run_id']}/"), \
        lines[at: at + 2]
    assert run["report"]["url"] == url and "mlflow-artifacts:" not in ui["run_out"]
    browser.open(url)
    browser.wait("document.body && document.body.innerText.includes('r1flow run: recipe eval, profile tiny') && "
                 "document.body.innerText.includes('MLflow parent run')", what="report.md in the Artifacts tab")
    browser.wait(_in_model_training_view(run["experiment_id"]), timeout=20, what="the model-training sidebar")


def test_the_reports_registry_links_open_the_model_version_in_the_model_training_view(ui):
    """The report's "Model registry" links, followed from its Prefect artifact page: each version's link opens that
    version's registry page, and the model's link the model's, in MLflow's model-training view (its sidebar has
    the Model registry entry, not GenAI's Prompts), and the model's description has no stray links (a bare
    `@final` rendered as github.com/final). Before issue 59 the one link, `#/models/<name>`, opened the model in
    the GenAI view."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    browser.open(f"{info.prefect.url}/artifacts/artifact/{_report_artifact_id(info, run['flow_run_id'])}")
    browser.wait("document.body && document.body.innerText.includes('Model registry')", what="the report")
    links = browser.js("[...document.querySelectorAll('a')].map(a => [a.innerText.trim(), a.href])"
                       ".filter(([, h]) => h.includes('/#/models/'))")
    versions = [(text, href) for text, href in links if "/versions/" in href]
    assert versions and len(links) == len(versions) + 1, links  # the registered model, then each version
    registry_view = ("[...document.querySelectorAll('a')].some(a => a.innerText.trim() === 'Model registry') && "
                     "![...document.querySelectorAll('a')].some(a => (a.getAttribute('href') || '') === '#/prompts')")
    for text, href in links:
        assert href.startswith(f"{info.mlflow.url}/#/models/r1flow-eval") and href.endswith(
            "?workflowType=machine_learning"), href
        browser.open(href)
        shown = text.capitalize() if "/versions/" in href else "Versions"  # a version's page names it
        browser.wait(f"document.body && document.body.innerText.includes({json.dumps(shown)})", what=f"{href}")
        browser.wait(registry_view, timeout=20, what=f"the model-training view at {href}")
        assert not browser.js("[...document.querySelectorAll('a')].some(a => a.href.includes('github.com'))"), href


def test_every_report_table_fits_prefects_artifact_pane(ui):
    """At a 1280 px window every table of the report is inside Prefect's artifact pane (its cells never wrap):
    the run's own report, and one with r1-tools' longest names (its sections made by the report's own functions
    from the recipe's plan: model comparison with a previous row, tool use, stage gains) published to the same
    server. Before issue 59 the stage table (its key-metrics cell) and the model comparison were 1106 and 1211 px
    wide in a 700 px pane: their right halves were cut."""
    info, browser, run = ui["info"], ui["browser"], ui["run"]
    tables = _tables_fit(browser, f"{info.prefect.url}/artifacts/artifact/"
                                  f"{_report_artifact_id(info, run['flow_run_id'])}", "stage (kind)")
    assert len(tables) >= 3 and all(t["fits"] for t in tables), (tables, browser.screenshot())
    created = _get_json(f"{info.prefect_api_url}/artifacts/", {"key": "r1flow-report-tables", "type": "markdown",
                                                               "data": _r1_tools_sections()})
    tables = _tables_fit(browser, f"{info.prefect.url}/artifacts/artifact/{created['id']}", "eval")
    headers = " / ".join(t["header"] for t in tables)
    assert "tool error rate" in headers and "gain, points [95% CI]" in headers and "acc: products" in headers, headers
    assert all(t["fits"] for t in tables), (tables, browser.screenshot())


def _r1_tools_sections() -> str:
    """The model comparison (with a previous row under each eval), tool use and stage gains of an r1-tools run, as
    the report writes them, with numbers as wide as they get."""
    from types import SimpleNamespace

    from flows.plan.recipes import load_plan
    from flows.plan.results import StageResult
    from flows.report.comparison import (
        comparison_markdown,
        comparison_payload,
        comparison_rows,
        tool_use_markdown,
    )
    from flows.report.gains import gain_pairs, gains_markdown

    plan = load_plan("r1-tools", "tiny")
    wide = {"accuracy": 0.5, "accuracy_ci_low": 0.363, "accuracy_ci_high": 0.637, "accuracy_lenient": 0.516,
            "pass_at_4": 0.828, "format_rate": 0.984, "mean_length": 187.25, "tokens_per_s": 1234.5, "prompts": 64.0,
            "tool_calls_per_answer": 1.266, "tool_error_rate": 0.123, "turns": 2.266,
            **{f"calls_{b}/{k}": 0.516 for b in ("0", "1", "2plus") for k in ("accuracy", "share")},
            **{f"{t}/accuracy{s}": v for t in ("products", "chain_sum")
               for s, v in (("", 0.5), ("_ci_low", 0.363), ("_ci_high", 0.637))}}
    results = [StageResult(n.name, n.stage, "run", 12.3, outputs={"model" if n.stage != "eval" else "results": "f" * 64},
                           metrics=wide if n.stage == "eval" else {}) for n in plan.nodes]
    rows = comparison_rows(plan, results)
    previous = {"parent_run_id": "7c68b6b3" * 4, "rows": [{**r, "model_fingerprint": "e" * 64} for r in rows]}
    tracker = SimpleNamespace(experiment_id="1", run_url=lambda run_id, exp=None: None,
                              run_path=lambda run_id, exp=None: f"#/experiments/1/runs/{run_id}")
    gains = [{**p, "gain": -0.125, "ci_low": -0.25, "ci_high": 0.0, "prompts": 64, "note": ""} for p in gain_pairs(plan)]
    md = comparison_markdown(comparison_payload(plan, "p" * 32, rows, previous), tracker)
    return "\n".join([*md, *tool_use_markdown(results), *gains_markdown(gains)]) + "\n"
