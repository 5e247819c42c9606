"""The planner: predict step times of a MoE model under a parallel layout on hardware far
larger than this machine, and choose the layout. Torch-free (``calibrate`` alone imports
torch, inside its functions).

    hardware.py    profiles (YAML, every figure with its source)
    model_spec.py  the shapes that cost time, from a HF config.json
    layout.py      tp / dp / pp / ep, redundant experts, two-batch overlap, MTP
    cost_model.py  FLOPs, bytes and seconds of each op on one rank
    memory.py      weights, KV cache and activations per rank
    simulator.py   one decode and one prefill pass
    search.py      batches under TTFT / TPOT targets, ranking, node sweeps
    pd_ratio.py    the best fixed prefill:decode split of N instances for a phased workload
    availability/  the cost of a rank or node loss under elastic EP, uptime, redundancy
    cli.py         ``moeserve plan`` (cli_pd.py: ``--pd-instances``; cli_availability.py:
                   ``--availability``);  plot.py  sweeps as a PNG
    calibrate/     ``moeserve plan calibrate``: micro.py (bandwidth, GEMMs, experts, gloo),
                   engine.py (the engine's own steps: host overheads, collectives),
                   host.py (the CPU model, ISA and caches a profile was measured on)
"""

from moeserve.planner.hardware import HardwareProfile, ProfileError, load_profile
from moeserve.planner.layout import Layout, enumerate_layouts
from moeserve.planner.model_spec import ModelSpec, ModelSpecError, load_model_spec
from moeserve.planner.search import Plan, Workload, evaluate, rank_layouts, sweep

__all__ = [
    "HardwareProfile",
    "Layout",
    "ModelSpec",
    "ModelSpecError",
    "Plan",
    "ProfileError",
    "Workload",
    "enumerate_layouts",
    "evaluate",
    "load_model_spec",
    "load_profile",
    "rank_layouts",
    "sweep",
]
