"""Entry point: `python -m stored` and the `stored` console script."""

from __future__ import annotations

from flexmarl import daemon
from stored.app import build_app
from stored.config import StoredConfig

DESCRIPTION = "FlexMARL stored: durable experience store and content-addressed blob store."


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT."""
    raise SystemExit(daemon.main("stored", StoredConfig, build_app, description=DESCRIPTION))


if __name__ == "__main__":
    main()
