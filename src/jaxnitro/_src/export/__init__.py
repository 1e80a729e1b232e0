"""Export and load serving bundles: `jn.export_model(n, dir)` writes one, `jn.load_bundle(dir)`
runs it without the model's code. The format is in `format.py`; see docs/export.md.

It may import `core`, `experiment`, `optim`, `steps`, `compile` and `train` (a
bundle is checked against the predict program); `run`'s `Nitro` in annotations only.
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
