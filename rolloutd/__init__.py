"""rolloutd daemon."""
