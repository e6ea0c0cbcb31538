"""Ready-made multi-agent workflows, configured entirely in the job spec (docs/workflows.md).

``environment.entrypoint: flexmarl.workflows:SolverVerifier`` (or ``Debate``, ``Chain``,
``Mixture``) with ``environment.config`` naming the agents, the prompts (templates over the task
rows' fields) and the rewards per role (:mod:`flexmarl.rewards` functions by name).
"""

from __future__ import annotations

from flexmarl.workflows.base import RewardSpec, Template, Workflow
from flexmarl.workflows.chain import Chain
from flexmarl.workflows.debate import Debate
from flexmarl.workflows.mixture import Mixture
from flexmarl.workflows.solver_verifier import SolverVerifier

__all__ = ["Chain", "Debate", "Mixture", "RewardSpec", "SolverVerifier", "Template", "Workflow"]
