"""traind daemon."""
