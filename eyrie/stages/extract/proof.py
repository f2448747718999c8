"""The capture proof on a running extraction server (`eyrie.hidden_states.proof` says what is proved): the server
answers the proof's prompts greedily, its capture of prompt and answer is read back from staging with its own
top-`SERVER_TOP_K` ranking from the same forward pass (`ServerClient.extract_ranked`), and the verdict is recorded
in `<run>/extract/capture/proof.json` (aux layers the proof could not recompute, under
`extraction.unproven_aux_layers: warn`, also in its `warnings`, which the run's warnings repeat). Once per server
process: a server the run's regeneration proved already is not asked again.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from eyrie.hidden_states.check import GREEDY_MIN_AGREEMENT, CaptureError
from eyrie.hidden_states.proof import (
    ANSWER_TOKENS,
    PROOF,
    RANK_MIN_OVERLAP,
    SERVER_TOP_K,
    Ranking,
    judge,
    proof_prompts,
)
from eyrie.run.files import atomic_write_json

if TYPE_CHECKING:
    import torch


def _greedy(client, prompt: list[int], timeout_s: float) -> list[int]:
    """ANSWER_TOKENS greedy tokens for `prompt` from the server, as regeneration asks (no file written, a prefix
    cache salt of its own), past an end-of-sequence token so the count is fixed."""
    from eyrie.vllm.plugin import SKIP_HIDDEN_STATES
    from eyrie.vllm.spec import GENERATION_CACHE_SALT

    body = {
        "model": "target",
        "prompt": prompt,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0.0,
        "top_p": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "cache_salt": GENERATION_CACHE_SALT,
        "kv_transfer_params": {SKIP_HIDDEN_STATES: True},
    }
    r = client.session.post(client.base_url + "/v1/completions", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise CaptureError(f"the capture proof's greedy request was refused: {r.status_code} {r.text[:300]}")
    tokens = r.json()["choices"][0].get("token_ids")
    if not tokens:
        raise CaptureError("the server's greedy answer carries no token ids (return_token_ids needs vLLM >= 0.10.2)")
    return list(tokens)


def _captured(client, ids: list[int], timeout_s: float) -> tuple[torch.Tensor, Ranking]:
    """The server's capture of `ids`, read and removed from staging: [T, n_layers, H] float32, and the server's own
    top-SERVER_TOP_K ranking at each of the T positions from the same forward pass (`ServerClient.extract_ranked`)."""
    import torch
    from safetensors.torch import load_file

    from eyrie.hidden_states.encoding import decode

    path, ranking = client.extract_ranked(ids, timeout_s, SERVER_TOP_K)
    lock = path + ".lock"  # the connector's writer holds LOCK_EX on it until the file is whole
    if os.path.exists(lock):
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
        os.unlink(lock)
    try:
        data = decode(load_file(path), torch.float32)
    finally:
        Path(path).unlink(missing_ok=True)
    if data["token_ids"].tolist() != ids:
        raise CaptureError("the server's capture is for other token ids than were sent")
    return data["hidden_states"].float(), ranking


def proof_samples(
    client, source_dir: Path, max_model_len: int, timeout_s: float = 600
) -> list[tuple[torch.Tensor, list[int], int, Ranking]]:
    """What the proof judges, from the server `client` talks to: for each proof prompt of the data, the server's
    greedy answer, then its capture of prompt and answer with its own ranking from that forward pass
    ([(hs, token ids, prompt length, ranking)], as `judge` takes them)."""
    samples = []
    for prompt in proof_prompts(source_dir, max_model_len):
        ids = prompt + _greedy(client, prompt, timeout_s)
        hs, ranking = _captured(client, ids, timeout_s)
        samples.append((hs, ids, len(prompt), ranking))
    return samples


def prove_capture(
    client, ctx: dict, source_dir: Path, capture_dir: Path, max_model_len: int, timeout_s: float = 600, log=print
) -> dict:
    """Run the proof on the server `client` talks to (see the module's docstring). Records the figures (or the
    problems) in `capture_dir/proof.json`; raises CaptureError on a refusal."""
    t0 = time.perf_counter()
    samples = proof_samples(client, source_dir, max_model_len, timeout_s)
    served = time.perf_counter() - t0
    capture_dir.mkdir(parents=True, exist_ok=True)
    try:
        figures = judge(ctx, samples, log)
    except CaptureError as err:
        atomic_write_json(capture_dir / PROOF, {"passed": False, "reason": str(err)})
        raise
    figures.update(passed=True, seconds=round(time.perf_counter() - t0, 2), server_seconds=round(served, 2))
    atomic_write_json(capture_dir / PROOF, figures)
    return figures


def prove_server(
    ctx: dict,
    source_dir: Path,
    capture_dir: Path,
    server_state: dict | None,
    client,
    max_model_len: int,
    timeout_s: float = 600,
    log=print,
) -> dict:
    """The proof for the extraction server `client` talks to, once per server process: a server this run's other
    stage (regeneration) proved already, for the same context, is not asked again. `server_state`: its
    `server.json` (pid, fingerprint, start and ready times)."""
    from eyrie.run.files import read_json, sha256_json

    instance = (
        {k: server_state.get(k) for k in ("pid", "started_at", "ready_at", "fingerprint")} if server_state else None
    )
    context = sha256_json(ctx)[:16]
    done = read_json(capture_dir / PROOF)
    if instance and isinstance(done, dict) and done.get("passed") and done.get("server") == instance:
        if done.get("context") == context:
            log(f"capture proved on this server already ({capture_dir / PROOF})")
            return done
    figures = prove_capture(client, ctx, source_dir, capture_dir, max_model_len, timeout_s, log)
    figures.update(server=instance, context=context)
    atomic_write_json(capture_dir / PROOF, figures)
    head = figures.get("head_check", {})
    aux = figures.get("aux_check", {})
    greedy = head.get("greedy_vs_forward", {})
    log(
        f"capture proved in {figures['seconds']} s on {figures['prompts']} prompts with greedy answers: layer "
        f"{ctx['num_layers']} through the target's head against the server's own ranking from the same forward pass "
        f"at {head.get('positions')} positions: top-1 {head.get('top1_agreement')} (exact {head.get('top1_exact')}; "
        f"at least {GREEDY_MIN_AGREEMENT}, a near-tie within {head.get('tie_nats')} nats or "
        f"{head.get('tie_bf16_steps')} bf16 steps counted in), top-{head.get('top_k')} overlap "
        f"{head.get('topk_overlap')} (exact {head.get('topk_overlap_exact')}; at least {RANK_MIN_OVERLAP}); the greedy "
        f"answers' tokens {greedy.get('agreement')} (top-1 {greedy.get('top1')}, a figure); aux layers "
        + (
            ", ".join(f"{k}: {v['own']}" for k, v in aux.get("relative_l2", {}).items())
            + " (relative L2) from the target's own stream, recomputed"
            if aux.get("relative_l2")
            else "none recomputed"
        )
        + (
            f"; aux layers {aux['unproven']} unproven ({aux.get('reason')}), accepted by {aux.get('allowed_by')}"
            if aux.get("unproven")
            else ""
        )
    )
    return figures
