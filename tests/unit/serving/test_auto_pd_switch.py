"""The adaptive P/D controller's role switch against a stand-in for sglang-router's worker API
and an instance's role endpoint (``httpx.MockTransport``): after every outcome the instance
is registered in the role it really serves. The real router and instances:
``tests/e2e/test_pd_auto.py``."""

from __future__ import annotations

import json

import httpx
import pytest

from moeserve.serving.auto_pd import AutoPD, Worker
from moeserve.serving.auto_pd_policy import AutoPDOptions
from moeserve.serving.supervisor import StopFlag

ROUTER = "http://router"
URL = "http://instance"


class Fake:
    """The router's workers (``url -> (role, bootstrap port)``) and the instance's answer to a
    role switch; ``fail`` names the calls that fail next (each once)."""

    def __init__(self, switch_status: int = 200) -> None:
        self.workers = {URL: ("decode", None)}
        self.switch_status = switch_status
        self.fail: list[str] = []
        self.calls: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        call = f"{request.method} {request.url.path}"
        self.calls.append(call)
        if call in self.fail:
            self.fail.remove(call)
            return httpx.Response(500, json={"error": {"message": "injected"}})
        if request.url.host == "instance":
            assert call == "POST /admin/disaggregation/role"
            if self.switch_status != 200:
                return httpx.Response(409, json={"error": {"message": "still draining"}})
            return httpx.Response(200, json={"disaggregation_bootstrap_port": 9123})
        if call == "GET /workers":
            listed = [
                {"id": f"id-{u}", "url": u, "worker_type": r, "is_healthy": True}
                | {"bootstrap_port": p}
                for u, (r, p) in self.workers.items()
            ]
            return httpx.Response(200, json={"workers": listed})
        if request.method == "DELETE":
            self.workers.pop(request.url.path.removeprefix("/workers/id-"), None)
            return httpx.Response(200)
        if call == "POST /workers":
            w = json.loads(request.content)
            self.workers[w["url"]] = (w["worker_type"], w.get("bootstrap_port"))
            return httpx.Response(200)
        raise AssertionError(f"unexpected call {call}")


def controller(fake: Fake) -> AutoPD:
    ctl = AutoPD(ROUTER, AutoPDOptions(), StopFlag())
    ctl.http.close()
    ctl.http = httpx.Client(transport=httpx.MockTransport(fake.handle))
    return ctl


WORKER = Worker(id=f"id-{URL}", url=URL, role="decode", healthy=True)


def test_a_switch_re_registers_the_instance_in_its_new_role_with_its_port():
    fake = Fake()
    s = controller(fake).switch(WORKER, "prefill")
    assert s.ok and s.error is None and (s.old, s.new) == ("decode", "prefill")
    assert fake.workers == {URL: ("prefill", 9123)}
    assert fake.calls.index("POST /admin/disaggregation/role") > fake.calls.index(
        f"DELETE /workers/id-{URL}"
    )


def test_a_refused_switch_registers_the_instance_in_its_old_role():
    fake = Fake(switch_status=409)
    s = controller(fake).switch(WORKER, "prefill")
    assert not s.ok and "HTTP 409: still draining" in s.error
    assert fake.workers == {URL: ("decode", None)}


def test_a_switched_instance_whose_registration_failed_is_registered_in_its_new_role():
    fake = Fake()
    fake.fail = ["POST /workers"]  # the first registration, in the new role, fails
    s = controller(fake).switch(WORKER, "prefill")
    assert not s.ok and "500" in s.error
    assert fake.workers == {URL: ("prefill", 9123)}  # not "decode": it serves as prefill now


@pytest.mark.parametrize("failing", ["GET /workers", "POST /admin/disaggregation/role"])
def test_a_router_or_instance_failure_mid_switch_loses_no_instance(failing):
    fake = Fake()
    fake.fail = [failing]
    s = controller(fake).switch(WORKER, "prefill")
    assert not s.ok
    assert fake.workers == {URL: ("decode", None)}
