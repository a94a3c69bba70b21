"""Coupled losses: exact accumulation when the loss ties a window's examples together.

``coupled`` (``_cache``): GradCache's two passes, with the representations gathered over the
ranks (``_exchange``) and pass 1's random numbers replayed (``_replay``).
``window_stats`` (``_stats``): a pass of statistics summed over the window and the ranks (an
MoE layer's expert counts) before the accumulated pass that uses them as constants.
"""
