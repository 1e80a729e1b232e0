"""`jaxnitro.datasets`, the public module: re-exports `jaxnitro._src.data.datasets` (its home).

`import jaxnitro.datasets` and `from jaxnitro.datasets import ...` work as they always did.
"""

from jaxnitro._src.data.datasets import mnist as mnist
