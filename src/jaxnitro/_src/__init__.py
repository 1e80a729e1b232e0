"""jaxnitro's internals, one subpackage per layer (docs/layout.md).

The public face is the top-level ``jaxnitro`` namespace (``import jaxnitro as jn``). The
subpackages here may change between releases; they live under ``_src`` so that public
names such as ``jn.train`` never shadow them.
"""
