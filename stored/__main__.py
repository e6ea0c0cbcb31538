"""Entry point: `python -m stored` and the `stored` console script."""

from __future__ import annotations

from flexmarl import daemon
from flexmarl.daemon import DaemonApp, DaemonContext
from stored.config import StoredConfig

DESCRIPTION = "FlexMARL stored: durable experience store and content-addressed blob store."


def _build(config: StoredConfig, context: DaemonContext) -> DaemonApp:
    """Builds the app; imported only after the flags parsed, so ``--help`` and a bad flag answer at once."""
    from stored.app import build_app

    return build_app(config, context)


def main() -> None:
    """Runs the daemon until SIGTERM/SIGINT, then ends the process without interpreter teardown."""
    daemon.exit_process(daemon.main("stored", StoredConfig, _build, description=DESCRIPTION))


if __name__ == "__main__":
    main()
