from __future__ import annotations

import httpx
import openai
import pytest

from moeserve.demo import tiny_model_path
from tests.e2e.pd_compare import Deployment, deploy, stop_all
from tests.e2e.server import API_KEY, RunningServer, start_server


@pytest.fixture(scope="package")
def server() -> RunningServer:
    """One server on the demo model for the e2e tests that do not stop or restrict it."""
    srv = start_server("--api-key", API_KEY, "--enable-debug-endpoints", "--max-num-seqs", "64")
    yield srv
    srv.stop_cleanly()


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def http(server) -> httpx.Client:
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    ) as c:
        yield c


@pytest.fixture()
def model(client) -> str:
    return client.models.list().data[0].id


# -- prefill/decode deployments, shared by the test_pd_*.py files ---------------------------------


@pytest.fixture(scope="package")
def pd_demo() -> Deployment:
    """A colocated, a prefill and a decode instance on the demo model (DeepSeek-V3 layout)."""
    d = deploy(str(tiny_model_path()))
    yield d
    stop_all(d.instances)


@pytest.fixture(scope="package")
def pd_qwen(tmp_path_factory) -> Deployment:
    """The same three instances on a tiny Qwen3-MoE checkpoint (GQA)."""
    from tests.checkpoints import build_hf_model, save_hf_checkpoint

    path = tmp_path_factory.mktemp("ckpt") / "qwen3-moe-tiny"
    save_hf_checkpoint(build_hf_model("qwen3_moe"), path)
    d = deploy(str(path))
    yield d
    stop_all(d.instances)
