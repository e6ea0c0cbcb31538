"""FlexMARL: shared package (protos, runtime, registry, SDK and CLI)."""

__version__ = "0.1.0"
