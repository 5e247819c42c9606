"""Every script under ``benchmarks/`` still imports and parses its arguments: a benchmark runs
rarely and by hand (an ARM host's one-command run calls several), so a rename elsewhere in
the package can break one unseen. One process imports each script as its sibling imports
expect (``benchmarks/`` on the path) and calls the ``main()`` of those that have one with
``--help``; the modules without one are the helpers the others import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HELPERS = {"bench_model.py", "pd_instances.py", "roofline.py", "server_process.py"}

CHECK = """
import contextlib, importlib, io, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
helpers = set(sys.argv[1:])
for f in sorted(Path("benchmarks").glob("*.py")):
    mod = importlib.import_module(f.stem)
    main = getattr(mod, "main", None)
    if main is None:
        assert f.name in helpers, f"{f.name}: no main() and not a known helper module"
        continue
    sys.argv = [f.name, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main()
    except SystemExit as e:
        assert e.code in (0, None), f"{f.name} --help exited {e.code}"
    else:
        raise AssertionError(f"{f.name}: main() returned on --help")
    print(f.name)
"""


def test_every_benchmark_imports_and_takes_help():
    done = subprocess.run(
        [sys.executable, "-c", CHECK, *sorted(HELPERS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    checked = set(done.stdout.split())
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert checked == scripts - HELPERS
