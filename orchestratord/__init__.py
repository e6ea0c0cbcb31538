"""orchestratord daemon."""
