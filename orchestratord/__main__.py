"""Entry point: `python -m orchestratord` and the `orchestratord` console script."""

from __future__ import annotations

from flexmarl import daemon
from orchestratord.app import build_app
from orchestratord.config import OrchestratorConfig

DESCRIPTION = "FlexMARL orchestratord: jobs, policy versions, leases and the micro-batch pipeline."


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT."""
    raise SystemExit(daemon.main("orchestratord", OrchestratorConfig, build_app, description=DESCRIPTION))


if __name__ == "__main__":
    main()
