"""Entry point of a rank spawned by ``processes.WorkerProcesses``: ``python -m
moeserve.launch.worker '<json>'`` with the rank's LaunchSpec, EngineConfig and binding.

The rank exits on its own when the process that spawned it disappears; its last error goes
to ``$MOESERVE_ERROR_FILE`` so the driver can name it. SIGINT is left to the process that
spawned it; SIGTERM asks rank 0 to stop the group (``start.run_rank``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback


def _orphan_watch(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)  # the driver is gone: nobody will send a stop


def main(argv: list[str]) -> int:
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    # a terminal's Ctrl-C reaches the whole process group: the process that spawned this
    # rank decides what it means (a drain of the group), the rank follows rank 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from moeserve.config import EngineConfig
        from moeserve.launch.numa import RankBinding
        from moeserve.launch.spec import LaunchSpec
        from moeserve.launch.start import run_rank

        payload = json.loads(argv[0])
        spec = LaunchSpec(**payload["spec"])
        config = EngineConfig(**payload["config"])
        b = payload["binding"]
        binding = RankBinding(b["local_rank"], b["numa_node"], tuple(b["cpus"]), b["num_threads"])
        return run_rank(spec, config, binding)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then exit non-zero
        path = os.environ.get("MOESERVE_ERROR_FILE")
        if path:
            with open(path, "w") as f:
                f.write(f"{type(e).__name__}: {e}")
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
