"""shoal.sim: discrete-event simulator of the task-pool protocol, the neutral judge of plans.

Public API: :func:`simulate`, :class:`SimResult`, :func:`plot_timeline`, :class:`SimConfig`,
:class:`Straggler`, :class:`ServerFailure`, :func:`check_plan`.
"""

from shoal.sim.config import ServerFailure, SimConfig, Straggler
from shoal.sim.engine import check_plan, simulate
from shoal.sim.result import SimResult, plot_timeline

__all__ = ["simulate", "SimResult", "plot_timeline", "SimConfig", "Straggler", "ServerFailure", "check_plan"]
