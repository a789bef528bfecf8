"""The deterministic verifier worker (MarginGate's reference model).

- `model`:  batch-invariant Llama / Qwen2 / Qwen3 decoder on `mg_server.verifier.kernels`, over weights in
  SGLang's layout (SGLang's own tensors on CUDA, a fused checkpoint on CPU).
- `budget`: the K/V pool's size on a GPU.
- `engine`: shadow K/V cache per protected request, lazy catch-up, batched verify forwards, audit.
- `server`: `VerifierConfig` + `run_verifier` / `start_verifier` (the worker process).
- `client`: `VerifierClient` (connect / verify / verify_many / release / stats /
  shutdown), typed `VerifierError`s, timeouts.
- `kernels/`: the batch-invariant ops (`ops` binds the ones the model calls).
Messages are in `mg_server.wire.protocol`, SGLang's shared weights in `mg_server.wire.weights`.

Contract: same weights + same token prefix + same kernel configuration => bit-identical logits,
token, margin and K/V column, whatever the batch, the chunking of the prefix (catch-up gaps),
the thread count, the pool's slots, or the process. The K/V column of position p is the K (after
rotate-half RoPE) and V computed for the input token t_p at position p, all layers:
[layers, 2, kv_heads, head_dim] in the model dtype (SGLang's MHATokenToKVPool layout per layer).
"""
