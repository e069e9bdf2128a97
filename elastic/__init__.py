"""elastic: fault-tolerant, elastic PyTorch training on etcd v3."""

__version__ = "0.1.0"

__all__ = ["__version__"]
