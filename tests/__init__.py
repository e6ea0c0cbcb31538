"""FlexMARL's test suite, a package: tests/orchestratord and tests/traind never stand in for the real ones."""
