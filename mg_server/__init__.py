"""mg_server: per-request deterministic greedy decoding for SGLang (MarginGate)."""

__version__ = "0.1.0"
