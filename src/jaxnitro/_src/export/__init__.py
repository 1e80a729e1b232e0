"""Export and load serving bundles: `jn.export_model(n, dir)` writes one, `jn.load_bundle(dir)`
runs it without the model's code. The format is in `format.py`; see docs/export.md.

It may import every layer below it (`core` to `train`, a bundle is checked against the
predict program) and the public modules; `serve` and `cli` never.
"""

from jaxnitro._src.core.errors import BundleError, BundleInputError, ExportError
from jaxnitro._src.export.bundle import Bundle, load_bundle
from jaxnitro._src.export.format import TensorSpec
from jaxnitro._src.export.writer import export_model

__all__ = [
    "Bundle",
    "BundleError",
    "BundleInputError",
    "ExportError",
    "TensorSpec",
    "export_model",
    "load_bundle",
]
