"""Entry point: `python -m rolloutd` and the `rolloutd` console script."""

from __future__ import annotations

from flexmarl import daemon
from flexmarl.daemon import DaemonApp, DaemonContext
from rolloutd.config import RolloutConfig

DESCRIPTION = "FlexMARL rolloutd: multi-agent episodes on inference engines."


def _build(config: RolloutConfig, context: DaemonContext) -> DaemonApp:
    """Builds the app; imported only after the flags parsed, so ``--help`` and a bad flag answer at once."""
    from rolloutd.app import build_app

    return build_app(config, context)


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT, then ends the process without interpreter teardown."""
    daemon.exit_process(daemon.main("rolloutd", RolloutConfig, _build, description=DESCRIPTION))


if __name__ == "__main__":
    main()
