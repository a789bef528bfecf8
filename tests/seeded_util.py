"""Helpers of the seeded-sampling server checks (tests/test_seeded_server.py, and the mg-off check
in tests/test_determinism.py, which reuses that module's mode-off server)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests

T, MAX_NEW = 0.8, 20
DET = {"X-Deterministic": "1"}


def seeds(n: int) -> list[int]:
    return [1000 + i for i in range(n)]


def sampled_references(model: str, ids: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """The verifier-alone answers of seeded sampling at T with seeds(len(ids))."""
    import torch

    from mg_server.verifier.reference import greedy_reference, load_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # results do not depend on it; one thread leaves a core to the rest
    try:
        refs = greedy_reference(load_engine(model), ids, max_new, temperature=T, seeds=seeds(len(ids)))
    finally:
        torch.set_num_threads(threads)
    return [r.tokens for r in refs]


def sample(url: str, ids: list[int], seed: int | None, header: bool = True, max_new: int = MAX_NEW,
           temperature: float = T) -> tuple[list[int], str]:
    """/generate of a token prompt -> (output token ids, X-MG-Verdict)."""
    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": temperature}
    if seed is not None:
        params["sampling_seed"] = seed
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": params},
                      headers=DET if header else {}, timeout=600)
    r.raise_for_status()
    return r.json()["output_ids"], r.headers.get("x-mg-verdict", "")


def mixed_round(url: str, ids, others, k: int) -> list[tuple[list[int], str]]:
    """Seeded deterministic requests (seeds(len(ids))) sent concurrently with plain sampled, plain
    greedy and deterministic greedy neighbours of other lengths (k varies the neighbours)."""
    with ThreadPoolExecutor(8) as pool:
        det = [pool.submit(sample, url, p, s) for p, s in zip(ids, seeds(len(ids)))]
        for j, o in enumerate(others):
            pool.submit(sample, url, o, 7 + j + k, header=False, max_new=5 + 7 * j + k)  # SGLang's own sampling
            pool.submit(sample, url, o, None, header=(j % 2 == 0), max_new=9 + 3 * j, temperature=0)
        return [f.result() for f in det]
