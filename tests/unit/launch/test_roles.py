"""Which part of ``serve`` a process runs, the topology launchers hand to the engine, the
LWS variables as flags, and the rendezvous checks that fail fast."""

from __future__ import annotations

import socket

import pytest

from moeserve.cli import build_parser, engine_kwargs
from moeserve.config import EngineConfig
from moeserve.launch.host import API, HOST, RANK, serve_role
from moeserve.launch.netif import check_rendezvous
from moeserve.launch.spec import LaunchSpec, detect_external, free_port
from moeserve.launch.start import with_topology


def _config(**kw) -> EngineConfig:
    return EngineConfig(model="unused", data_parallel_size=2, enable_expert_parallel=True, **kw)


TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}
SLURM = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NNODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "cn[07-08]",
    "SLURM_JOB_ID": "1234",
}


def test_the_api_runs_where_world_rank_0_runs():
    assert serve_role(_config(), {}) == API
    assert serve_role(_config(nnodes=2, node_rank=1, master_addr="a", master_port=1), {}) == HOST
    assert serve_role(_config(), TORCHRUN) == RANK
    assert serve_role(_config(), {**TORCHRUN, "RANK": "0"}) == API
    assert serve_role(_config(), SLURM) == API
    assert serve_role(_config(), {**SLURM, "SLURM_PROCID": "2", "SLURM_NODEID": "1"}) == RANK


@pytest.mark.parametrize("env", [TORCHRUN, SLURM], ids=["torchrun", "slurm"])
def test_a_launchers_topology_reaches_the_engine_config(env):
    spec = detect_external(env)
    config = with_topology(_config(), spec)
    assert (config.nnodes, config.node_rank) == (2, spec.node_rank)
    assert config.moe_options.num_nodes == 2  # node-affine replicas and hierarchical EPLB
    assert (config.master_addr, config.master_port) == (spec.master_addr, spec.master_port)
    if env is SLURM:
        assert (config.master_addr, config.master_port) == ("cn07", 20000 + 1234)


def test_a_node_flag_that_contradicts_the_launcher_is_refused():
    spec = detect_external(TORCHRUN)
    with pytest.raises(ValueError, match="--nnodes 3 disagrees with the torchrun environment"):
        with_topology(_config(nnodes=3, node_rank=0, master_addr="x", master_port=1), spec)
    same = with_topology(_config(nnodes=2, node_rank=1, master_addr="x", master_port=1), spec)
    assert same.nnodes == 2


def _kwargs(argv: list[str], monkeypatch, env: dict[str, str]) -> dict:
    for name in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return engine_kwargs(build_parser().parse_args(["serve", *argv]))


def test_a_leaderworkerset_pod_gets_its_flags_from_lws(monkeypatch):
    lws = {"LWS_LEADER_ADDRESS": "ms-0.ms.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    got = _kwargs(["--ep", "4"], monkeypatch, lws)
    assert (got["nnodes"], got["node_rank"], got["master_addr"], got["master_port"]) == (
        2,
        1,
        "ms-0.ms.ns",
        29500,
    )
    assert serve_role(EngineConfig(**got), {}) == HOST
    with pytest.raises(ValueError, match="--node-rank 0 conflicts with LWS_WORKER_INDEX=1"):
        _kwargs(["--ep", "4", "--node-rank", "0"], monkeypatch, lws)
    plain = _kwargs([], monkeypatch, {})
    assert (plain["nnodes"], plain["node_rank"], plain["master_addr"]) == (1, 0, None)


def _spec(rank: int, addr: str, port: int, source: str = "flags") -> LaunchSpec:
    return LaunchSpec(2, rank, 0, 1, 2, rank, addr, port, source)


def test_rank_0s_host_must_own_the_master_address_and_port():
    check_rendezvous(_spec(0, "127.0.0.1", free_port()))
    with pytest.raises(ValueError, match="is not an address of this host"):
        check_rendezvous(_spec(0, "192.0.2.7", free_port()))  # TEST-NET-1: nobody's
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"--master-port {port} on 127.0.0.1 is not free"):
            check_rendezvous(_spec(0, "127.0.0.1", port))
        check_rendezvous(_spec(0, "127.0.0.1", port, source="torchrun"))  # its agent's store


def test_other_hosts_need_a_name_that_resolves():
    with pytest.raises(ValueError, match="does not resolve"):
        check_rendezvous(_spec(1, "no-such-host.invalid", 29500))
    check_rendezvous(_spec(1, "127.0.0.1", 29500))  # a route exists: the join decides


def test_a_one_task_srun_step_runs_one_engine_that_binds_its_bootstrap_once(monkeypatch, tmp_path):
    """A prefill instance started as a one-task srun step (deploy/slurm/moeserve-pd.sbatch):
    the plain engine, not an engine group of one, whose control would bind the bootstrap
    port a second time (it failed with "Address already in use")."""
    from moeserve.engine.engine import LLMEngine
    from moeserve.launch.start import start_engine
    from tests.checkpoints import build_hf_model, save_hf_checkpoint

    model = save_hf_checkpoint(build_hf_model("qwen3_moe"), tmp_path / "qwen")
    one_task = {
        **SLURM,
        "SLURM_NTASKS": "1",
        "SLURM_NNODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_STEP_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
    }
    for key, value in one_task.items():
        monkeypatch.setenv(key, value)
    assert detect_external(one_task).world_size == 1
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        disaggregation_mode="prefill",
        disaggregation_bootstrap_port=free_port(),
    )
    engine = start_engine(config)
    try:
        assert type(engine) is LLMEngine
        assert engine.disaggregation_mode == "prefill"
    finally:
        engine.shutdown()
