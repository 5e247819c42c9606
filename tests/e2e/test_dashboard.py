"""deploy/monitoring/ queries only what a live server exports: every metric in every PromQL
expression of the Grafana dashboard (panel targets, template variables) and of the alert
rules is a sample name in ``/metrics`` of one server whose traffic makes every series appear
(EP 2 with redundant experts and live EPLB, MTP speculative decoding) or of a prefill/decode
pair after a request between them (the KV-transfer series), and every label those
expressions match, group by or print is a label of one of their metrics; every series the
server exports is on the dashboard. Where a Prometheus is installed, it scrapes that server
and answers every query with series. The dashboard's JSON model holds what Grafana needs to
import it (unique ids, a grid without overlaps, every query on the ``datasource`` variable).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests import debian
from tests.e2e.dashboard_queries import (
    ALERTS,
    alert_queries,
    all_panels,
    dashboard_queries,
    fill_in,
    for_parser,
    load,
    problems,
    references,
)
from tests.e2e.server import RunningServer, start_server

# one server that exports every series: EP (eplb_imbalance needs a placement), live EPLB with
# a short interval (the before/after gauges need a re-placement), MTP drafts (spec_decode_*)
FULL_SERVER = ("--ep", "2", "--ep-num-redundant-experts", "2", "--enable-eplb")
FULL_SERVER += ("--eplb-interval", "8", "--speculative-num-tokens", "2", "--max-num-seqs", "16")
NOT_ON_DASHBOARD: dict[str, str] = {}  # exported series the dashboard leaves out, and why
PANEL_TYPES = {"row", "timeseries", "stat", "table", "heatmap", "bargauge", "gauge"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


# -- the live server ---------------------------------------------------------------------------


def _traffic(url: str) -> None:
    """Completions and chat completions, batched, streamed and not: more than eight engine
    steps, so EPLB re-places at least once."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    greedy = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    client.completions.create(model=model, prompt=[f"expert {i}" for i in range(4)], **greedy)
    list(client.completions.create(model=model, prompt="a stream", stream=True, **greedy))
    messages = [{"role": "user", "content": "hello"}]
    client.chat.completions.create(model=model, messages=messages, **greedy)
    list(client.chat.completions.create(model=model, messages=messages, stream=True, **greedy))


@pytest.fixture(scope="module")
def full_server() -> Iterator[RunningServer]:
    """The server of FULL_SERVER after :func:`_traffic`."""
    srv = start_server(*FULL_SERVER)
    try:
        _traffic(srv.url)
        yield srv
    finally:
        srv.stop_cleanly()


@pytest.fixture(scope="module")
def pd_pair() -> Iterator[tuple[RunningServer, RunningServer]]:
    """A prefill and a decode instance (the KV-transfer series) after one request given to
    both at once with the bootstrap fields a router adds."""
    port = _free_port()
    prefill = start_server(
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)
    )
    decode = None
    try:
        decode = start_server("--disaggregation-mode", "decode")
        body = {
            "prompt": "a prompt long enough to fill a block of the cache, and more",
            "max_tokens": 4,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port,
            "bootstrap_room": 7,
        }

        async def both() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as c:
                rs = await asyncio.gather(
                    *(c.post(f"{s.url}/v1/completions", json=body) for s in (prefill, decode))
                )
            return [r.status_code for r in rs]

        assert asyncio.run(both()) == [200, 200]
        yield prefill, decode
    finally:
        prefill.stop_cleanly()
        if decode is not None:
            decode.stop_cleanly()


def _scrape(url: str, out: dict[str, set[str]]) -> None:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)


@pytest.fixture(scope="module")
def exposed(full_server, pd_pair) -> dict[str, set[str]]:
    """Sample name -> label names, of a scrape of the full server after the traffic and of
    the prefill/decode pair."""
    out: dict[str, set[str]] = {}
    for srv in (full_server, *pd_pair):
        _scrape(srv.url, out)
    return out


def test_every_queried_metric_and_label_is_in_a_live_metrics(exposed):
    dash, rules = load()
    found = problems(dashboard_queries(dash) + alert_queries(rules), exposed)
    assert not found, "\n" + "\n".join(found)


def test_every_exported_series_is_on_the_dashboard(exposed):
    dash, _ = load()
    shown = set().union(*(references(q.expr)[0] for q in dashboard_queries(dash)))
    left_out = {n for n in exposed if n.startswith("moeserve:") and not n.endswith("_created")}
    left_out -= shown | set(NOT_ON_DASHBOARD)
    fix = "add a panel to moeserve-dashboard.json, or a reason to NOT_ON_DASHBOARD"
    assert not left_out, f"{sorted(left_out)}: {fix}"


def test_the_check_fails_on_a_missing_metric_a_rename_and_a_lost_label(exposed):
    dash, _ = load()
    before = problems(dashboard_queries(dash), exposed)  # none, unless the test above fails
    added = copy.deepcopy(dash)
    panel = copy.deepcopy(next(p for p in all_panels(added) if p["type"] == "timeseries"))
    panel["id"], panel["targets"] = 999, [{"refId": "A", "expr": "rate(moeserve:nope_total[5m])"}]
    added["panels"].append(panel)
    new = [m for m in problems(dashboard_queries(added), exposed) if m not in before]
    assert new == [f"panel 999 {panel['title']!r} target A: moeserve:nope_total is not in /metrics"]
    renamed = {k.replace("kv_cache_usage_perc", "kv_cache_usage"): v for k, v in exposed.items()}
    missing = [m for m in problems(dashboard_queries(dash), renamed) if m not in before]
    assert missing and all("moeserve:kv_cache_usage_perc is not in /metrics" in m for m in missing)
    lost = {k: v - {"engine"} for k, v in exposed.items()}
    assert any("label 'engine'" in m for m in problems(dashboard_queries(dash), lost))


# -- a real Prometheus -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"no {what} in {timeout:g} s")


@pytest.fixture()
def prometheus(full_server, pd_pair, tmp_path) -> Iterator[str]:
    """Debian's ``prometheus`` (installed when missing and root, else skipped): one
    scraping the full server and the prefill/decode pair every second, with the alert rules
    loaded. Yields its URL."""
    debian.ensure_installed(("prometheus",), ("prometheus",))
    binary = shutil.which("prometheus")
    targets = [s.url.removeprefix("http://") for s in (full_server, *pd_pair)]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "moeserve", "static_configs": [{"targets": targets}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{_free_port()}"
    cmd = [binary, f"--config.file={tmp_path / 'prometheus.yml'}"]
    cmd += [f"--web.listen-address={address}", f"--storage.tsdb.path={tmp_path / 'data'}"]
    log = tmp_path / "prometheus.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while _status(f"http://{address}/-/ready") != 200:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.25)
            yield f"http://{address}"
        finally:
            proc.terminate()
            proc.wait(30)


def _pd_traffic(pair: tuple[RunningServer, RunningServer], room: int) -> None:
    """One request given to the prefill and the decode instance at once, as a router does."""
    info = httpx.get(f"{pair[0].url}/server_info", timeout=10).json()
    port = info["disaggregation_bootstrap_port"]
    body = {"prompt": f"traffic {room} " * 8, "max_tokens": 4, "bootstrap_host": "127.0.0.1"}
    body |= {"bootstrap_port": port, "bootstrap_room": room}

    async def both() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(c.post(f"{s.url}/v1/completions", json=body) for s in pair))

    asyncio.run(both())


def test_a_prometheus_scraping_the_server_answers_every_query(full_server, pd_pair, prometheus):
    """After 15 s of requests, every dashboard query, filled in as Grafana sends it, returns
    series (no error, and no empty answer: a matching or a grouping that cannot hold shows
    here, which a reading of the names cannot), and every alert rule evaluates cleanly."""

    def query(expr: str) -> list[dict]:
        r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    t0 = time.monotonic()
    room = 1000
    while time.monotonic() - t0 < 15:  # longer than the rate interval below
        _traffic(full_server.url)
        room += 1
        _pd_traffic(pd_pair, room)
    name = "moeserve:prompt_tokens_total"
    sent = _scrape_value(full_server.url, name)
    _until(
        "scrape after the traffic", lambda: [r for r in query(name) if float(r["value"][1]) == sent]
    )

    dash, rules = load()
    values = {
        "model_name": query(name)[0]["metric"]["model_name"],
        "instance": "|".join(s.url.removeprefix("http://") for s in (full_server, *pd_pair)),
        "layer": min(r["metric"]["layer"] for r in query("moeserve:expert_tokens_total")),
    }
    empty = [
        q.where
        for q in dashboard_queries(dash)
        if not query(fill_in(q.expr, values, rate_interval="15s", range_="1m"))
    ]
    assert not empty, empty

    def evaluated() -> dict[str, str]:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"]
        got = [r for g in groups for r in g["rules"]]
        never = [r for r in got if r["lastEvaluation"].startswith("0001-")]  # Go's zero time
        return {} if never else {r["name"]: r["health"] for r in got}

    health = _until("evaluation of every alert rule", evaluated)
    assert health == {r["alert"]: "ok" for g in rules["groups"] for r in g["rules"]}


def _scrape_value(url: str, name: str) -> float:
    """The value of the series ``name`` (one sample) in ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


# -- the expressions alone ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, metrics, labels",
    [
        (
            'histogram_quantile(0.99, sum by (le) (rate(m:a_bucket{x=~"a|b(c)", y="{z}"}'
            "[$__rate_interval])))",
            {"m:a_bucket"},
            {"le", "x", "y"},
        ),
        (
            "sum(rate(a_total[5m] offset 1h)) / on (layer) group_left (expert) avg by(layer) (b)",
            {"a_total", "b"},
            {"layer", "expert"},
        ),
        ("1 + max without (e) (c) > bool 1e3 and d @ start() or e > Inf", {"c", "d", "e"}, {"e"}),
        ("a * on (x) group_left b unless c offset -5m", {"a", "b", "c"}, {"x"}),
        (
            'sum(increase(rate_total{k="rate("}[$__range])) / count(sum_total)',
            {"rate_total", "sum_total"},
            {"k"},
        ),
    ],
)
def test_references(expr, metrics, labels):
    assert references(expr) == (metrics, labels)


@pytest.mark.parametrize("expr", ['{__name__="m"}', "rate(m[5m]) > $threshold"])
def test_references_refuses_what_it_cannot_read(expr):
    with pytest.raises(ValueError):
        references(expr)


def test_every_expression_parses_and_the_parser_sees_the_same_metrics():
    """promql-parser (the Rust parser behind GreptimeDB, in Python) reads every expression;
    its vector selectors are the metrics :func:`references` found."""
    promql = pytest.importorskip("promql_parser")
    dash, rules = load()
    for q in dashboard_queries(dash) + alert_queries(rules):
        names: set[str] = set()

        def visit(node, names=names):
            if isinstance(node, promql.VectorSelector) and node.name:
                names.add(node.name)

        promql.walk(promql.parse(for_parser(q.expr)), pre_visit=visit)
        assert names == references(q.expr)[0], q.where
    with pytest.raises(ValueError):
        promql.parse("sum by (le) rate(m_bucket[5m])")


# -- the JSON model ----------------------------------------------------------------------------


def test_dashboard_model():
    dash, _ = load()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    panels = all_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["w"] > 0 and g["h"] > 0, p["id"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["id"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap"
                cells[(x, y)] = p["id"]
        assert p["type"] in PANEL_TYPES and p.get("title"), p["id"]
        if p["type"] == "row":
            assert g["w"] == 24 and g["h"] == 1 and "targets" not in p
            continue
        assert p["datasource"] == DATASOURCE and p["targets"], p["id"]
        assert all(t["datasource"] == DATASOURCE and t["expr"] for t in p["targets"]), p["id"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["id"]

    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for v in variables.values():
        assert v["type"] in ("datasource", "query"), v["name"]
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(dash["panels"]) + json.dumps(variables)))
    assert used - {"__rate_interval", "__range", "__interval"} <= set(variables)
    for p in panels:
        if "repeat" in p:
            assert variables[p["repeat"]]["multi"], p["id"]


def test_alert_rules_model():
    _, rules = load()
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert len(names) == len(set(names)) and names
    for g in rules["groups"]:
        assert g["name"] and g["rules"]
        for r in g["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
            assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
            assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
            assert r["annotations"]["summary"], r["alert"]
