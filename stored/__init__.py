"""stored daemon."""
