"""Adaptive P/D (``moeserve router --auto-pd``): move instances between the prefill and
decode roles while sglang-router serves, when the load's mix of prompt and output tokens
leaves one role short (the rule and its hysteresis: ``auto_pd_policy.py``).

Every ``interval_s``, on a thread of ``moeserve router``::

    GET router/workers                     the instances and the role each one is registered in
    GET instance/metrics (every one)       queues, TTFT and inter-token histograms
    the rule says: move one instance to role R (sustained, out of cooldown)
      pick the instance of the other role with the fewest requests in flight
      DELETE router/workers/{id}           new requests stop going to it
      POST instance/admin/disaggregation/role {mode: R, drain_timeout_s}
                                           it drains (its requests in flight finish, none is
                                           cut), switches its bootstrap control
                                           (``serving/role_switch.py``)
      POST router/workers {url, worker_type: R, bootstrap_port}
      wait until the router lists it healthy in role R
    a switch that fails (drain timeout, an error) registers the instance in its old role again

Why a controller of our own: sglang-router 0.3.2 balances load within a role but never
changes the roles (its workers' roles are what they were registered with); its worker API
(``POST /workers``, ``DELETE /workers/{id}``) is what this uses to re-register.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from moeserve.serving.auto_pd_policy import (
    AutoPDOptions,
    Hysteresis,
    Sample,
    Scrape,
    parse_metrics,
    signals,
    wanted_move,
)
from moeserve.serving.supervisor import StopFlag

logger = logging.getLogger("moeserve.router.auto_pd")

_HTTP_TIMEOUT_S = 5.0  # one GET of /metrics or /workers
_ROUTER_WAIT_S = 30.0  # for the router to apply a worker's removal or addition
_POLL_S = 0.2


@dataclass(frozen=True)
class Worker:
    """One instance as the router lists it."""

    id: str
    url: str
    role: str
    healthy: bool
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class Switch:
    """One role switch, for the log and the tests."""

    url: str
    old: str
    new: str
    ok: bool
    seconds: float
    error: str | None = None


class AutoPD:
    """The controller over the router at ``router_url``."""

    def __init__(
        self,
        router_url: str,
        options: AutoPDOptions,
        stop: StopFlag,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_url = router_url
        self.options = options
        self.stop = stop
        self.clock = clock
        self.hysteresis = Hysteresis(options)
        self.window: list[Sample] = []
        self.switches: list[Switch] = []
        self.http = httpx.Client(timeout=_HTTP_TIMEOUT_S, trust_env=False)
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    # -- the loop -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="auto-pd", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float) -> None:
        """Stop after the current tick (a switch under way finishes: it is bounded by the
        drain timeout and the router's answers)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        logger.info(
            "auto-pd: watching every %g s (TTFT %g ms, TPOT %g ms, %g%% of requests)",
            self.options.interval_s,
            self.options.ttft_ms,
            self.options.tpot_ms,
            100 * self.options.target,
        )
        try:
            while not self.stop.sleep(self.options.interval_s) and not self._closed.is_set():
                try:
                    self.tick()
                except httpx.HTTPError as e:  # the router itself did not answer: next tick
                    logger.warning("auto-pd: the router did not answer: %s", e)
        finally:
            self.http.close()

    def tick(self) -> Switch | None:
        """One look at every instance; switches one when the rule says so."""
        workers = self.workers()
        now = self.clock()
        roles = {w.url: w.role for w in workers}
        scrapes: dict[str, Scrape] = {}
        for w in workers:
            try:
                scrapes[w.url] = parse_metrics(self.http.get(f"{w.url}/metrics").text)
            except (httpx.HTTPError, ValueError) as e:
                logger.debug("auto-pd: no metrics from %s: %s", w.url, e)
        self.window.append(Sample(now, roles, scrapes))
        while self.window and now - self.window[0].at > self.options.window_s:
            self.window.pop(0)
        sig = signals(self.window, self.options)
        counts = {r: sum(1 for w in workers if w.role == r) for r in ("prefill", "decode")}
        to = self.hysteresis.observe(wanted_move(sig, counts, self.options), now)
        if to is None:
            return None
        donors = [w for w in workers if w.role != to and w.healthy]
        if not donors:
            return None
        donor = min(donors, key=lambda w: _in_flight(scrapes.get(w.url)))
        logger.info(
            "auto-pd: %s is short (prefill queue %.2f, decode queue %.2f, TTFT ok %s, "
            "TPOT ok %s): moving %s from %s to %s",
            to,
            sig.prefill_queue,
            sig.decode_queue,
            _pct(sig.ttft_ok),
            _pct(sig.tpot_ok),
            donor.url,
            donor.role,
            to,
        )
        switch = self.switch(donor, to)
        self.hysteresis.switched(to, self.clock())
        self.window.clear()  # it measured the old split
        return switch

    # -- the router's worker API ------------------------------------------------------------

    def workers(self) -> list[Worker]:
        r = self.http.get(f"{self.router_url}/workers")
        r.raise_for_status()
        return [
            Worker(
                id=w["id"],
                url=w["url"].rstrip("/"),
                role=w.get("worker_type", ""),
                healthy=bool(w.get("is_healthy")),
                bootstrap_port=w.get("bootstrap_port"),
            )
            for w in r.json().get("workers", [])
            if w.get("worker_type") in ("prefill", "decode")
        ]

    def _wait_listed(self, url: str, role: str | None) -> bool:
        """Until the router lists ``url`` healthy in ``role`` (None: no longer lists it)."""
        deadline = self.clock() + _ROUTER_WAIT_S
        while True:
            listed = {w.url: w for w in self.workers()}
            w = listed.get(url)
            if (role is None and w is None) or (
                role is not None and w is not None and w.role == role and w.healthy
            ):
                return True
            if self.clock() >= deadline:
                return False
            time.sleep(_POLL_S)

    def _register(self, url: str, role: str, bootstrap_port: int | None) -> None:
        body: dict = {"url": url, "worker_type": role}
        if role == "prefill":
            body["bootstrap_port"] = bootstrap_port
        self.http.post(f"{self.router_url}/workers", json=body).raise_for_status()
        if not self._wait_listed(url, role):
            raise RuntimeError(
                f"the router did not list {url} as a healthy {role} worker "
                f"within {_ROUTER_WAIT_S:g} s"
            )

    def switch(self, worker: Worker, to: str) -> Switch:
        """Move ``worker`` to role ``to`` (module docstring). On failure it is registered
        again in the role it then has: its old one when the instance refused or never
        answered the switch, the new one when it switched but its registration failed (a
        second try)."""
        t0 = self.clock()
        role, port = worker.role, worker.bootstrap_port  # what the instance serves as now
        error = None
        try:
            self.http.delete(f"{self.router_url}/workers/{worker.id}").raise_for_status()
            if not self._wait_listed(worker.url, None):
                logger.warning("auto-pd: the router still lists %s after its removal", worker.url)
            r = self.http.post(
                f"{worker.url}/admin/disaggregation/role",
                json={"mode": to, "drain_timeout_s": self.options.drain_timeout_s},
                timeout=self.options.drain_timeout_s + 30,
            )
            if r.status_code == 200:
                role, port = to, r.json().get("disaggregation_bootstrap_port")
                self._register(worker.url, to, port)
            else:
                error = f"HTTP {r.status_code}: {_message(r)}"
        except (httpx.HTTPError, RuntimeError, ValueError) as e:  # ValueError: a bad JSON
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            logger.error(
                "auto-pd: moving %s from %s to %s failed (%s); registering it as %s",
                worker.url, worker.role, to, error, role,
            )  # fmt: skip
            try:
                self._register(worker.url, role, port)
            except (httpx.HTTPError, RuntimeError) as e:
                logger.error("auto-pd: could not register %s as %s: %s", worker.url, role, e)
        switch = Switch(worker.url, worker.role, to, error is None, self.clock() - t0, error)
        if switch.ok:
            logger.info(
                "auto-pd: %s moved from %s to %s in %.2f s", worker.url, worker.role, to,
                switch.seconds,
            )  # fmt: skip
        self.switches.append(switch)
        return switch


def _in_flight(scrape: Scrape | None) -> float:
    return (scrape.waiting + scrape.running) if scrape is not None else float("inf")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
