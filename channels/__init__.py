"""Channels: how models travel between the server and the clients (plain arrays, Paillier or CKKS
ciphertexts, Flower's SecAgg+ masking).

A channel is one plugin: its server half (a :class:`fedsim.seams.ServerChannel`, registered in
:data:`fedsim.components.CHANNELS`) names its client half (``client = ...``, a
:class:`fedsim.seams.ClientChannel`), and both live in one module or package here, so the ClientApp finds
the client half through the same ``channel.name`` (a registered name or an import reference) that the
server built its half from. The channels' message keys are spelled in :mod:`fedsim.protocol` (the one
place every wire key lives). The plain channel (the default) is the core's own
(:class:`fedsim.seams.PlainChannel`). Channels import only the core; nothing but the composition root
imports this package (docs/plugins.md: writing a channel).
"""
from channels import ckks, paillier, secagg  # noqa: F401
