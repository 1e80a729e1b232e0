"""Devices and processes: device selection and the data mesh (`devices`), the
`jax.distributed` runtime and its exchanges (`distributed`, public as `jaxnitro.distributed`),
`jaxnitro launch` (`launcher`), and how arrays are split over the mesh (`sharding`).

It may import `core`, `compile` (the persistent cache `setup_devices` sets up), `experiment`
and `optim` (the sharding rules read the parameter groups).
"""
