"""``python -m rolloutd.engines.embedded``: see :mod:`rolloutd.engines.embedded.cli`."""

from rolloutd.engines.embedded.cli import main

if __name__ == "__main__":
    main()
