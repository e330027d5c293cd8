"""shoal.plan: scenarios, the time-cost model, the allocator, baselines and online repair."""

from shoal.plan.api import METHODS, make_plan
from shoal.plan.cost import CostOptions, predict
from shoal.plan.repair import repair
from shoal.plan.scenario import (
           BUILTIN_SCENARIOS,
           load_scenario,
           scenario_from_dict,
           scenario_to_dict,
)
from shoal.plan.validate import validate_plan

__all__ = ["BUILTIN_SCENARIOS", "METHODS", "CostOptions", "load_scenario", "make_plan", "predict", "repair",
           "scenario_from_dict", "scenario_to_dict", "validate_plan"]
