"""The deterministic verifier worker (MarginGate's reference model).

- `model`:  batch-invariant Llama / Qwen2 / Qwen3 decoder on `mg_server.verifier.kernels` (HF checkpoints).
- `engine`: shadow K/V cache per protected request, lazy catch-up, batched verify forwards, audit.
- `server`: `VerifierConfig` + `run_verifier` / `start_verifier` (the worker process).
- `client`: `VerifierClient` (connect / verify / verify_many / kv_column / release / stats /
  shutdown), typed `VerifierError`s, timeouts.
- `bench`:  `python -m mg_server.verifier.bench --out X.json`.
- `kernels/`: the batch-invariant ops (`ops` binds the ones the model calls).
Messages are in `mg_server.wire.protocol`, the K/V slot buffer in `mg_server.wire.shm`.

Contract: same weights + same token prefix + same kernel configuration => bit-identical logits,
token, margin and K/V column, whatever the batch, the chunking of the prefix (catch-up gaps),
the thread count, the slot layout, or the process. The K/V column of position p is the K (after
rotate-half RoPE) and V computed for the input token t_p at position p, all layers:
[layers, 2, kv_heads, head_dim] in the model dtype (SGLang's MHATokenToKVPool layout per layer).
"""
