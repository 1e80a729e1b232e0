"""Export and load serving bundles: `jn.export_model(n, dir)` writes one, `jn.load_bundle(dir)`
runs it without the model's code. The format is in `format.py`; see docs/export.md."""

from ..errors import BundleError, BundleInputError, ExportError
from .bundle import Bundle, load_bundle
from .format import TensorSpec
from .writer import export_model

__all__ = [
    "Bundle",
    "BundleError",
    "BundleInputError",
    "ExportError",
    "TensorSpec",
    "export_model",
    "load_bundle",
]
