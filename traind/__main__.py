"""Entry point: `python -m traind` and the `traind` console script."""

from __future__ import annotations

from flexmarl import daemon
from flexmarl.daemon import DaemonApp, DaemonContext
from traind.config import TrainerConfig

DESCRIPTION = "FlexMARL traind: DeepSpeed training of the agents bound to its slots."


def _build(config: TrainerConfig, context: DaemonContext) -> DaemonApp:
    """Builds the app; imported only after the flags parsed, so ``--help`` and a bad flag answer at once."""
    from traind.app import build_app

    return build_app(config, context)


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT, then ends the process without interpreter teardown."""
    daemon.exit_process(daemon.main("traind", TrainerConfig, _build, description=DESCRIPTION))


if __name__ == "__main__":
    main()
