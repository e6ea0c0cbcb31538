"""Entry point: `python -m traind` and the `traind` console script."""

from __future__ import annotations

from flexmarl import daemon
from traind.app import build_app
from traind.config import TrainerConfig

DESCRIPTION = "FlexMARL traind: DeepSpeed training of the agents bound to its slots."


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT."""
    raise SystemExit(daemon.main("traind", TrainerConfig, build_app, description=DESCRIPTION))


if __name__ == "__main__":
    main()
