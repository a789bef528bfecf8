"""Calibration of MarginGate's tau (`mg-server calibrate`, paper §4.3).

The fast path (a real SGLang server with mg off, batched, other prompts as neighbours) decodes a
prompt set at several batch sizes; every step's top-1/top-2 logit margin is compared with the
verifier-alone reference's token. A flip is a step whose token differs while the prefix still
equals the reference's (a synchronous step); after a flip the row is rolled back onto the
reference's prefix and decoding resumes, so every position of every sequence is a synchronous
step. The tau sweep turns these steps into trigger rate, flip recall and sequence determinism
per tau; the chosen tau and the data go into a profile JSON (read by `mg_server.policy`) and a PNG.

- `config.py`: the frozen configuration of a run.
- `fastpath.py`: the HTTP client that measures the fast path against the reference (rollback).
- `sweep.py`: pure statistics: flip rates, the tau sweep, the chosen tau, transfer.
- `profile.py`: the profile document and its consistency check.
- `plot.py`: the frontier plot and margin histograms (matplotlib).
- `run.py`: the command: references, server, measurement (cached per batch size), outputs.
"""
