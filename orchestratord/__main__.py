"""Entry point: `python -m orchestratord` and the `orchestratord` console script."""

from __future__ import annotations

from flexmarl import daemon
from flexmarl.daemon import DaemonApp, DaemonContext
from orchestratord.config import OrchestratorConfig

DESCRIPTION = "FlexMARL orchestratord: jobs, policy versions, leases and the micro-batch pipeline."


def _build(config: OrchestratorConfig, context: DaemonContext) -> DaemonApp:
    """Builds the app; imported only after the flags parsed, so ``--help`` and a bad flag answer at once."""
    from orchestratord.app import build_app

    return build_app(config, context)


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT, then ends the process without interpreter teardown."""
    daemon.exit_process(daemon.main("orchestratord", OrchestratorConfig, _build, description=DESCRIPTION))


if __name__ == "__main__":
    main()
