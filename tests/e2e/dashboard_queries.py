"""What the monitoring files under deploy/monitoring/ ask of a server: the PromQL of the
Grafana dashboard's panel targets and template variables and of the alert rules, read for
the metrics and labels each expression refers to, and checked against a scrape."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "moeserve-dashboard.json"
ALERTS = MONITORING / "moeserve-alerts.yaml"
TARGET_LABELS = {"instance", "job"}  # attached by Prometheus when it scrapes, not in /metrics
PROMETHEUS_SERIES = {"up"}  # made by Prometheus itself (the alert on a target that is down)

_GRAFANA_RANGE = re.compile(
    r"\$(?:__(?:rate_interval|interval|range)\b|\{__(?:rate_interval|interval|range)\})"
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{([^{}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_IDENT = re.compile(r"(?<![\w:.])[A-Za-z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
_KEYWORDS |= {"by", "without", "on", "ignoring", "group_left", "group_right"}  # without labels
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")
_ALERT_LABEL = re.compile(r"\$labels\.([A-Za-z_]\w*)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.+),\s*([A-Za-z_]\w*)\s*\)\s*$", re.S)


def for_parser(expr: str) -> str:
    """``expr`` with Grafana's range variables as a duration (the others sit in strings)."""
    return _GRAFANA_RANGE.sub("5m", expr)


def references(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) of a PromQL expression: the names of its vector selectors,
    and the labels its matchers and its by/without/on/ignoring/group_* clauses name. Raises
    ValueError for what would hide a metric from this reading: a selector by ``__name__``, or
    a Grafana variable outside a string or a range."""
    text = _STRING.sub('""', for_parser(expr))
    labels: set[str] = set()
    for body in _BRACES.findall(text):
        labels |= set(_MATCHER.findall(body))
    if "__name__" in labels:
        raise ValueError(f"select metrics by name, not by __name__: {expr}")
    text = _BRACES.sub(" ", _BRACKETS.sub(" ", text))
    for names in _GROUPING.findall(text):
        labels |= {n.strip() for n in names.split(",") if n.strip()}
    text = _GROUPING.sub(" ", text)
    if "$" in text:
        raise ValueError(f"a Grafana variable outside a string or a range: {expr}")
    metrics = set()
    for m in _IDENT.finditer(text):
        name = m.group()
        if name.lower() in _KEYWORDS or re.match(r"\s*\(", text[m.end() :]):
            continue  # an operator, a constant, or a function / aggregation called
        metrics.add(name)
    return metrics, labels


@dataclass(frozen=True)
class Query:
    where: str  # "panel 12 'Title' target A", for the failure message
    expr: str
    shown: frozenset[str] = frozenset()  # labels printed in a legend or an alert's text


def dashboard_queries(dash: dict) -> list[Query]:
    """Every panel target's expression (rows' nested panels too) and every query variable's
    ``label_values(selector, label)``."""
    out = []
    for p in all_panels(dash):
        for t in p.get("targets", []):
            shown = frozenset(_LEGEND_LABEL.findall(t.get("legendFormat", "")))
            out.append(
                Query(f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"], shown)
            )
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = _LABEL_VALUES.match(q)
        assert m, f"variable {v['name']}: expected label_values(selector, label), got {q!r}"
        out.append(Query(f"variable {v['name']}", m.group(1), frozenset([m.group(2)])))
    return out


def alert_queries(rules: dict) -> list[Query]:
    out = []
    for g in rules["groups"]:
        for r in g["rules"]:
            text = " ".join(map(str, r.get("annotations", {}).values()))
            out.append(
                Query(f"alert {r['alert']}", r["expr"], frozenset(_ALERT_LABEL.findall(text)))
            )
    return out


def all_panels(dash: dict) -> list[dict]:
    return [q for p in dash["panels"] for q in (p, *p.get("panels", []))]


def problems(queries: list[Query], exposed: dict[str, set[str]]) -> list[str]:
    """What ``queries`` ask of a server exporting ``exposed`` (sample name -> its labels) that
    it does not have: metrics without a sample, and (where it has them all) labels on none of
    the query's metrics."""
    out = []
    for q in queries:
        metrics, labels = references(q.expr)
        if not metrics:
            out.append(f"{q.where}: queries no metric: {q.expr}")
        missing = sorted(metrics - PROMETHEUS_SERIES - set(exposed))
        out += [f"{q.where}: {m} is not in /metrics" for m in missing]
        if missing:
            continue  # its labels are unknown
        known = set(TARGET_LABELS).union(*(exposed.get(m, set()) for m in metrics))
        for label in sorted((labels | q.shown) - known):
            out.append(f"{q.where}: label {label!r} is on none of {sorted(metrics)}")
    return out


def load() -> tuple[dict, dict]:
    """(the dashboard's JSON model, the alert rules)."""
    return json.loads(DASHBOARD.read_text()), yaml.safe_load(ALERTS.read_text())


def fill_in(expr: str, values: dict[str, str], rate_interval: str, range_: str) -> str:
    """``expr`` as Grafana sends it: ``$name`` and ``${name}`` replaced by ``values[name]``,
    ``$__rate_interval`` (and ``$__interval``) by ``rate_interval``, ``$__range`` by
    ``range_``. Raises KeyError for a variable without a value."""
    builtins = {"__rate_interval": rate_interval, "__interval": rate_interval, "__range": range_}

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return builtins[name] if name in builtins else values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)
