"""The FP8 backends by name (imported when first asked for: each pulls in its library)."""
from __future__ import annotations


def fp8_backends() -> dict:
    from .ao import TorchAO
    from .native import Native
    from .te import TransformerEngine
    return {"te": TransformerEngine, "torchao": TorchAO, "native": Native}
