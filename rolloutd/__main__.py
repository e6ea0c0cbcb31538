"""Entry point: `python -m rolloutd` and the `rolloutd` console script."""

from __future__ import annotations

from flexmarl import daemon
from rolloutd.app import build_app
from rolloutd.config import RolloutConfig

DESCRIPTION = "FlexMARL rolloutd: multi-agent episodes on inference engines."


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT."""
    raise SystemExit(daemon.main("rolloutd", RolloutConfig, build_app, description=DESCRIPTION))


if __name__ == "__main__":
    main()
