"""Measurement: trackers (latency, memory, KV cache), the environment, and the run matrix."""
