"""The core: the sync protocol, the streaming state, the window engine, the transforms.

``accumulate`` and ``Accumulator`` drive any [`Sync`][gradaccum.sync.Sync] through the protocol
and never import a specific one.
"""
