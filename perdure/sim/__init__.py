"""A discrete-event simulation of a training run on a deployment, calibrated on the
costs this project measures (``benchmarks/results/*.json``).

``perdure sim CONFIG.toml`` simulates a deployment (regions, nodes, workers, links), a
workload (model size, batch, throughput, replicas of TP x PP x shard GPUs whose memory is
checked against the device: ``sharding.py``), failure processes (rates or schedules) and
four policies: perdure's re-planning, torchrun's restart from a checkpoint,
torchft's per-step quorum and DiLoCo across regions (``diloco.py``: inner steps per
region, an outer step every H); it reports goodput per policy with an interval over seeds,
tokens/s and bytes across regions per token against the synchronous step,
the step by dimension, every failure's cost by item (detection, wait, re-form, copy,
start-up, load, lost work, reduced strength), sweeps, plots and a validation against the
benchmarks' measured runs. See
``docs/simulation.md`` for the model, its assumptions, its validation and its limits.

No torch is imported here: the simulator runs anywhere the config parser does.
"""

from perdure.sim.calibrate import Calibration, CalibrationError, load_calibration
from perdure.sim.config import SimConfig, load_sim_config
from perdure.sim.run import Summary, run_config

__all__ = [
    "Calibration",
    "CalibrationError",
    "SimConfig",
    "Summary",
    "load_calibration",
    "load_sim_config",
    "run_config",
]
