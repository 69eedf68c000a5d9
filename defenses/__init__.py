"""Transforms applied by the channel to outgoing messages (noise, clipping, pruning, quantisation)."""
