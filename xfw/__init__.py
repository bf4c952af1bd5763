"""xfw: run one multimodal training recipe in PaddlePaddle and PyTorch, measure both the
same way, and report the difference. This package is the framework-neutral core: it never
imports a framework or an adapter (tests/unit/test_boundaries.py holds it to that)."""

__version__ = "0.1.0"
