"""A real one-node Slurm cluster on this machine, for the deployment tests.

    with running_cluster() as cluster:
        cluster.run("sbatch", "--parsable", script, ...)

Needs root: slurmd launches jobs as the submitting user, and the set-up may install Debian's
``slurm-wlm`` and ``munge`` with apt-get when they are missing. Not root, no apt-get, or an
install that fails skips the test with the reason.

Everything lives in a temporary directory: a munge key and a ``munged`` on its own socket,
a generated ``slurm.conf`` (this host as the one node, its CPU count, free ports, no cgroups:
``proctrack/linuxproc`` and ``task/none``), and ``slurmctld -D`` and ``slurmd -D`` as child
processes. Clients find the cluster through ``SLURM_CONF`` (``cluster.env``); every process of
the cluster and of its jobs inherits it, which is how the teardown finds what is left.

Every wait is bounded and its failure quotes the daemons' logs. The teardown cancels the
jobs still queued, stops the daemons and fails if any process of the cluster remains.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import debian
from tests.ports import free_port

_BINARIES = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "scancel",
    "sinfo",
    "scontrol",
)
_START_TIMEOUT_S = 60
_STOP_TIMEOUT_S = 20
KILL_WAIT_S = 10  # slurm.conf KillWait: SIGTERM to SIGKILL when a job is cancelled


class ClusterError(RuntimeError):
    """The cluster did not start, stop or answer as expected; the message quotes its logs."""


@dataclass(frozen=True)
class Proc:
    pid: int
    cmdline: str


@dataclass
class SlurmCluster:
    root: Path
    host: str
    cpus: int
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This environment without any Slurm job's variables, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(
        self, *args: str, timeout: float = 30, env: dict[str, str] | None = None, cwd=None
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; raises ClusterError on a timeout."""
        try:
            return subprocess.run(
                args,
                env={**self.env, **(env or {})},
                cwd=cwd or self.root,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            raise ClusterError(
                f"{' '.join(args)} did not finish in {timeout:g}s\n{self.logs()}"
            ) from e

    def logs(self, tail: int = 20, stdout_of: tuple[str, ...] = ()) -> str:
        """The last lines of every daemon's log file, and of the stdout/stderr of the daemons
        named in ``stdout_of`` (the same lines as the log, unless the daemon died early)."""
        paths = sorted((self.root / "log").glob("*.log"))
        paths += [self.root / "log" / f"{name}.out" for name in stdout_of]
        parts = []
        for path in paths:
            lines = path.read_text(errors="replace").splitlines()[-tail:] if path.exists() else []
            parts.append(f"--- {path.name} (last {len(lines)} lines) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    # ---- jobs ----------------------------------------------------------------------------------

    def job_queued(self, job_id: str) -> bool:
        """Whether squeue still lists the job (pending, running or completing)."""
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%i %T")
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:  # long gone: purged from slurmctld
                return False
            raise ClusterError(f"squeue -j {job_id} failed: {out.stderr}\n{self.logs()}")
        return bool(out.stdout.strip())

    def wait_job_gone(self, job_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.job_queued(job_id):
            if time.monotonic() > deadline:
                queue = self.run("squeue", "-o", "%i %j %T %M %R").stdout
                raise ClusterError(
                    f"job {job_id} still in squeue {timeout:g}s after it should have ended:\n"
                    f"{queue}\n{self.logs()}"
                )
            time.sleep(0.5)

    def job_processes(self, job_id: str, marker: str = "") -> list[Proc]:
        """Running processes of the job: its slurmstepds, whatever runs with its id, and any
        process whose command line holds ``marker`` (e.g. the job's model directory)."""
        stepd = f"slurmstepd: [{job_id}."
        return [
            p
            for p, environ in _live_processes()
            if p.cmdline.startswith(stepd)
            or (f"SLURM_JOB_ID={job_id}" in environ and self._ours(environ))
            or (marker and marker in p.cmdline)
        ]

    def wait_processes_gone(self, job_id: str, timeout: float, marker: str = "") -> None:
        deadline = time.monotonic() + timeout
        while procs := self.job_processes(job_id, marker):
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{len(procs)} process(es) of job {job_id} still running {timeout:g}s "
                    f"after it left the queue:\n" + "\n".join(f"{p.pid} {p.cmdline}" for p in procs)
                )
            time.sleep(0.5)

    def leftovers(self) -> list[Proc]:
        """Running processes that carry this cluster's SLURM_CONF and are not its daemons."""
        daemons = {d.pid for d in self.daemons.values() if d.poll() is None}
        return [p for p, env in _live_processes() if self._ours(env) and p.pid not in daemons]

    def _ours(self, environ: set[str]) -> bool:
        return f"SLURM_CONF={self.conf}" in environ


# ---- set-up -------------------------------------------------------------------------------------


@contextlib.contextmanager
def running_cluster() -> Iterator[SlurmCluster]:
    """Install if needed (or skip), start the daemons, yield the cluster; stop and check."""
    ensure_installed()
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        pytest.skip(f"this host's name {host!r} does not resolve: Slurm and moeserve use it")
    root = Path(tempfile.mkdtemp(prefix="moeserve-slurm-"))
    # munged wants its socket's directory, and every one above, searchable by all
    root.chmod(0o755)
    cluster = SlurmCluster(root, host, cpus=max(2, os.cpu_count() or 1))
    try:
        _start(cluster)
        yield cluster
    finally:
        try:
            _stop(cluster)
        finally:
            shutil.rmtree(root, ignore_errors=True)


def ensure_installed() -> None:
    """apt-get install slurm-wlm and munge when missing; pytest.skip when that can't be done."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm cluster test runs slurmd, which needs root")
    debian.ensure_installed(("slurm-wlm", "munge"), _BINARIES)


def slurm_conf(root: Path, host: str, cpus: int, memory_mb: int, ports: tuple[int, int]) -> str:
    """slurm.conf for one node: this host, no cgroups, all state under ``root``."""
    ctld_port, slurmd_port = ports
    return f"""\
ClusterName=moeserve-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={KILL_WAIT_S}
MailProg=/bin/true
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _start(cluster: SlurmCluster) -> None:
    root = cluster.root
    for d in ("munge", "state", "spool", "run", "log"):
        (root / d).mkdir(mode=0o755)
    key = root / "munge" / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    sock = root / "munge" / "munge.sock"
    _daemon(
        cluster,
        "munged",
        "-F",
        f"--socket={sock}",
        f"--key-file={key}",
        f"--pid-file={root}/run/munged.pid",
        f"--log-file={root}/log/munged.log",
        f"--seed-file={root}/munge/munged.seed",
    )
    _wait(cluster, "munged to create its socket", sock.exists)

    memory_mb = max(1, _memory_mb() * 9 // 10)
    ports = (free_port(), free_port())
    cluster.conf.write_text(slurm_conf(root, cluster.host, cluster.cpus, memory_mb, ports))
    _daemon(cluster, "slurmctld", "-D", "-f", str(cluster.conf))
    _daemon(cluster, "slurmd", "-D", "-f", str(cluster.conf), "-N", cluster.host)
    _wait(
        cluster, f"node {cluster.host} to be idle in sinfo", lambda: _node_state(cluster) == "idle"
    )


def _daemon(cluster: SlurmCluster, name: str, *args: str) -> None:
    """Start a daemon in the foreground as our child; its stdout/stderr go to log/NAME.out."""
    out = open(cluster.root / "log" / f"{name}.out", "wb")
    with out:
        cluster.daemons[name] = subprocess.Popen(
            [name, *args],
            env=cluster.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cluster.root,
            start_new_session=True,  # a ^C of pytest must not reach them before the teardown
        )


def _wait(cluster: SlurmCluster, what: str, ready, timeout: float = _START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = {n: d.returncode for n, d in cluster.daemons.items() if d.poll() is not None}
        if dead:
            raise ClusterError(
                f"waiting for {what}: {dead} exited\n{cluster.logs(stdout_of=tuple(dead))}"
            )
        if time.monotonic() > deadline:
            raise ClusterError(f"waited {timeout:g}s for {what}\n{cluster.logs()}")
        time.sleep(0.5)


def _node_state(cluster: SlurmCluster) -> str:
    out = cluster.run("sinfo", "-h", "-N", "-n", cluster.host, "-o", "%T")
    return out.stdout.strip() if out.returncode == 0 else ""


def _stop(cluster: SlurmCluster) -> None:
    """Cancel what is queued, stop the daemons, then fail if any of the cluster's processes
    remain (they are killed first, so that one failed test does not poison the next)."""
    problems = []
    if all(d.poll() is None for d in cluster.daemons.values()) and "slurmd" in cluster.daemons:
        try:
            queued = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
            if queued:
                cluster.run("scancel", *queued)
                for job in queued:
                    cluster.wait_job_gone(job, KILL_WAIT_S + 20)
        except ClusterError as e:
            problems.append(str(e))
    for name in reversed(list(cluster.daemons)):  # slurmd, slurmctld, then munged
        daemon = cluster.daemons[name]
        if daemon.poll() is None:
            daemon.terminate()
        try:
            daemon.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            problems.append(f"{name} ignored SIGTERM for {_STOP_TIMEOUT_S}s and was killed")
    left = _wait_leftovers(cluster, timeout=5)
    if left:
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        problems.append(
            "processes of the cluster outlived it (now killed):\n"
            + "\n".join(f"{p.pid} {p.cmdline}" for p in left)
        )
    if problems:
        raise ClusterError("\n".join(problems) + "\n" + cluster.logs())


def _wait_leftovers(cluster: SlurmCluster, timeout: float) -> list[Proc]:
    deadline = time.monotonic() + timeout
    while (left := cluster.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


# ---- the process table --------------------------------------------------------------------------


def _live_processes() -> Iterator[tuple[Proc, set[str]]]:
    """Every process we may read, with its environment, zombies left out (they have ended)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        yield Proc(int(entry.name), cmdline.strip()), set(environ)


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024
