"""`jaxnitro.datasets`, the public module: re-exports `jaxnitro.data.datasets` (its home).

`import jaxnitro.datasets` and `from jaxnitro.datasets import ...` work as they always did.
"""

from jaxnitro.data.datasets import mnist as mnist
