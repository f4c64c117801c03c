"""slm-align: align small language models safely and ship them to edge devices.

The public API, importable from the package itself::

    from slm_align import load_recipe, run_sft, run_reward, check_headroom, run_rl
    from slm_align import run_preference, run_evaluation
    from slm_align import merge_run, ExportRequest, run_export, Agent, default_tools

Names resolve on first use (PEP 562), so ``import slm_align`` stays light: the agent runtime on a
board imports neither torch nor transformers unless a training stage is asked for.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# torchao (which the executorch extra installs) logs at import, and transformers imports it on every
# model load, that its CUDA kernels do not load on a CPU-only torch; torch's pytree then logs that
# torchao's enums need no registration. Neither concerns slm-align, and both would reach stderr (a
# CLI error is one line there).
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

# public name -> "module:attribute" that defines it (the attribute is the name unless given)
_EXPORTS = {
    "Recipe": "slm_align.config",
    "load_recipe": "slm_align.config",
    "UserError": "slm_align.errors",
    "StageResult": "slm_align.runs",
    "run_sft": "slm_align.sft.stage",
    "run_reward": "slm_align.reward_model.stage",
    "check_headroom": "slm_align.headroom.stage",
    "run_rl": "slm_align.pipeline",
    "run_preference": "slm_align.pipeline",
    "run_evaluation": "slm_align.evaluate.stage:evaluate",
    "merge_run": "slm_align.export.converters.merge",
    "ExportRequest": "slm_align.export.publishing.stage",
    "run_export": "slm_align.export.publishing.stage",
    "run_quickstart": "slm_align.quickstart",
    "Agent": "slm_align.ondevice.agent.runtime",
    "default_tools": "slm_align.ondevice.tools.builtin",
    "write_function_tasks": "slm_align.data.function_tasks",
    "simulate_field": "slm_align.ondevice.agent.field",
}

__all__ = [
    "Agent",
    "ExportRequest",
    "Recipe",
    "StageResult",
    "UserError",
    "__version__",
    "check_headroom",
    "default_tools",
    "load_recipe",
    "merge_run",
    "run_evaluation",
    "run_export",
    "run_preference",
    "run_quickstart",
    "run_reward",
    "run_rl",
    "run_sft",
    "simulate_field",
    "write_function_tasks",
]

if TYPE_CHECKING:
    from slm_align.config import Recipe, load_recipe
    from slm_align.data.function_tasks import write_function_tasks
    from slm_align.errors import UserError
    from slm_align.evaluate.stage import evaluate as run_evaluation
    from slm_align.export.converters.merge import merge_run
    from slm_align.export.publishing.stage import ExportRequest, run_export
    from slm_align.headroom.stage import check_headroom
    from slm_align.ondevice.agent.field import simulate_field
    from slm_align.ondevice.agent.runtime import Agent
    from slm_align.ondevice.tools.builtin import default_tools
    from slm_align.pipeline import run_preference, run_rl
    from slm_align.quickstart import run_quickstart
    from slm_align.reward_model.stage import run_reward
    from slm_align.runs import StageResult
    from slm_align.sft.stage import run_sft


def __getattr__(name: str):
    """Import the module behind a public name the first time it is used."""
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'slm_align' has no attribute {name!r}")
    module_name, _, attribute = where.partition(":")
    value = getattr(importlib.import_module(module_name), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names and the public API's (resolved or not)."""
    return sorted(set(globals()) | set(_EXPORTS))
