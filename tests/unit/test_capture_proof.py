"""The capture proof run on every extraction server (eyrie/hidden_states/proof.py), in process on a tiny Llama: its
greedy answers and its true residual stream stand for the server's. The true capture passes; each planted wrong one
(the stream plus the layer's input, an off-by-one layer, zeros, another target's states, a stale shard) is refused,
naming the layer; aux ids whose prefix cannot be rebuilt (a quantized checkpoint, a prefix past the budget) are
refused, not passed, unless `extraction.unproven_aux_layers: warn` records them unproven; the ids within the budget
are proven either way, and preflight predicts all of it from the config before any load."""

from __future__ import annotations

import pytest
import torch
from capture_target import CAPTURED, LAYERS, capture_context, residual_stream, tiny_llama
from safetensors.torch import save_file

from eyrie.hidden_states import proof
from eyrie.hidden_states.check import CONTEXT, FOLDER, GREEDY_MIN_AGREEMENT, CaptureError, check_shard
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder, sample_path
from eyrie.stages.prepare import Shard

PROMPTS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny target and another one of the same shape (other weights); the proof's samples as the server would
    capture them: prompts, the target's greedy answers, the true stream at every layer."""
    folder = tmp_path_factory.mktemp("target")
    model = tiny_llama(folder, 0)
    other = tiny_llama(tmp_path_factory.mktemp("other"), 1)
    torch.manual_seed(2)
    samples = []
    for i in range(PROMPTS):
        prompt = torch.randint(3, 256, (1, 6 + 3 * i))
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=proof.ANSWER_TOKENS, do_sample=False, min_new_tokens=16)
        ids = out[0].tolist()
        samples.append((residual_stream(model, ids), residual_stream(other, ids), ids, prompt.shape[1]))
    return folder, samples


def server_ranking(model, ids: list[int]) -> list:
    """The server's own top-K ranking at every position of the forward pass over `ids`, as `extract_ranked` returns
    it: None at 0, then (ids best first, log-probabilities) from the target's logits rounded to bf16 (vLLM's)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    top = logits.to(torch.bfloat16).float().log_softmax(-1).topk(proof.SERVER_TOP_K, dim=-1)
    return [None] + [(top.indices[p - 1].tolist(), top.values[p - 1].tolist()) for p in range(1, len(ids))]


@pytest.fixture(scope="module")
def rankings(target):
    """The server's ranking for each proof sample: the target's own forward pass, whatever the capture wrote."""
    from transformers import LlamaForCausalLM

    folder, samples = target
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    return [server_ranking(model, ids) for _, _, ids, _ in samples]


def _captured(target_and_rankings, corrupt=None, other=False):
    """What the server would write for each proof prompt: the captured ids of the stream, in bf16 as stored, and
    the server's ranking from the same forward pass (the target's own: only the capture is planted wrong)."""
    (_, samples), rankings = target_and_rankings
    out = []
    for (own, theirs, ids, p), ranking in zip(samples, rankings, strict=True):
        s = (theirs if other else own).clone()
        if corrupt:
            s = corrupt(s)
        out.append((s[:, CAPTURED, :].to(torch.bfloat16).float(), ids, p, ranking))
    return out


def test_the_true_capture_is_proved_with_its_figures(target, rankings):
    folder, samples = target
    figures = proof.judge(capture_context(folder), _captured((target, rankings)), log=lambda m: None)
    head = figures["head_check"]
    # Every position of each prompt and its answer (the ranking at p pairs with the state at p - 1)
    assert head["positions"] == sum(len(ids) - 1 for _, _, ids, _ in samples), head
    assert head["top_k"] == proof.SERVER_TOP_K and "the forward pass that captured" in head["reference"], head
    assert head["top1_agreement"] == 1.0 and head["topk_overlap"] >= 0.99, head  # bf16 rounding alone
    assert head["greedy_vs_forward"]["positions"] == len(samples) * proof.ANSWER_TOKENS, head
    assert head["greedy_vs_forward"]["agreement"] >= 0.95, head  # recorded, not decisive
    errs = figures["aux_check"]["relative_l2"]
    assert set(errs) == {1, 2}
    assert all(e["own"] < 0.02 for e in errs.values()), errs  # bf16 storage of a float32 stream
    assert all(e["own"] < proof.NEIGHBOUR_MARGIN * min(e["before"], e["after"]) for e in errs.values()), errs


def _plus_input(s):  # the stream plus the layer's input, at every id (a contract summed twice)
    out = s.clone()
    for k in range(1, LAYERS + 1):
        out[:, k, :] = s[:, k, :] + s[:, k - 1, :]
    return out


def _aux_plus_input(s):  # the same on one aux layer only: the head check cannot see it
    s[:, 2, :] = s[:, 2, :] + s[:, 1, :]
    return s


def _aux_off_by_one(s):  # each aux id holds the layer's output (the input of the next): the old worker's shift
    s[:, 1, :], s[:, 2, :] = s[:, 2, :].clone(), s[:, 3, :].clone()
    return s


def _last_off_by_one(s):
    s[:, LAYERS, :] = s[:, LAYERS - 1, :]
    return s


def _aux_zeros(s):
    s[:, 1, :] = 0
    return s


@pytest.mark.parametrize(
    "corrupt, names",
    [
        # at layer 1 the added input (the embedding) is 1/23 of the stream: layers 2 and L name the contract
        (_plus_input, rf"layer {LAYERS} \(the last layer's output\)(.|\n)*layer 2: the captured stream is"),
        (_aux_plus_input, r"layer 2: the captured stream is"),
        (_aux_off_by_one, r"layer 1: .*from the one entering layer 2"),
        (_last_off_by_one, rf"layer {LAYERS} \(the last layer's output\)"),
        (_aux_zeros, r"layer 1: \d+ of \d+ rows are all zero"),
    ],
    ids=["stream-plus-input", "aux-stream-plus-input", "aux-off-by-one", "last-off-by-one", "zeros"],
)
def test_each_planted_wrong_capture_is_refused_naming_the_layer(target, rankings, corrupt, names):
    folder, samples = target
    with pytest.raises(CaptureError, match=names):
        proof.judge(capture_context(folder), _captured((target, rankings), corrupt), log=lambda m: None)


def test_another_targets_states_are_refused(target, rankings):
    folder, samples = target
    with pytest.raises(CaptureError) as err:
        proof.judge(capture_context(folder), _captured((target, rankings), other=True), log=lambda m: None)
    text = str(err.value)
    assert "layer 1: the captured stream is" in text and "layer 2: the captured stream is" in text, text
    assert f"layer {LAYERS} (the last layer's output)" in text, text


def test_a_target_that_cannot_be_rebuilt_is_refused_unless_the_config_accepts_it_unproven(target, rankings):
    folder, samples = target
    ctx = {**capture_context(folder), "quantized": True}
    with pytest.raises(CaptureError, match=r"aux layers \[1, 2\] cannot be proven: the checkpoint is quantized"):
        proof.judge(ctx, _captured((target, rankings)), log=lambda m: None)
    said: list[str] = []
    figures = proof.judge({**ctx, proof.AUX_POLICY: "warn"}, _captured((target, rankings)), log=said.append)
    assert figures["aux_check"]["unproven"] == [1, 2] and "relative_l2" not in figures["aux_check"], figures
    assert figures["aux_check"]["allowed_by"] == "extraction.unproven_aux_layers: warn"
    assert len(figures["warnings"]) == 1 and "[1, 2]" in figures["warnings"][0] and said, figures


@pytest.fixture
def budget_for_layer_1(target, monkeypatch):
    """RECOMPUTE_MAX_PARAMS set between the prefix aux id 1 needs (streams 0..2: embedding, 3 layers, head) and the
    one id 2 needs (streams 0..3): the tiny target stands for an 8B target whose L//2 and L-3 are past the budget."""
    folder, _ = target
    counts = proof._prefix_params(proof.text_config_of(capture_context(folder)), 3)
    assert counts[2] < counts[3]
    monkeypatch.setattr(proof, "RECOMPUTE_MAX_PARAMS", (counts[2] + counts[3]) // 2)
    monkeypatch.setattr(proof, "_PLANS", {})
    monkeypatch.setattr(proof, "_RECOMPUTERS", {})
    return counts


def test_the_shallow_aux_id_is_proven_when_the_deep_ones_prefix_is_past_the_budget(
    target, rankings, budget_for_layer_1
):
    folder, samples = target
    plan = proof.plan_for(capture_context(folder))
    assert (plan.layers, plan.proven, plan.unproven) == (2, [1], [2]), plan
    assert "first 4 layers and head hold" in plan.reason and "the proof rebuilds at most" in plan.reason, plan
    with pytest.raises(CaptureError, match=r"aux layers \[2\] cannot be proven: the proof rebuilds at most") as err:
        proof.judge(capture_context(folder), _captured((target, rankings)), log=lambda m: None)
    assert "extraction.unproven_aux_layers: warn" in str(err.value)
    figures = proof.judge(
        {**capture_context(folder), proof.AUX_POLICY: "warn"}, _captured((target, rankings)), log=lambda m: None
    )
    aux = figures["aux_check"]
    assert set(aux["relative_l2"]) == {1} and aux["relative_l2"][1]["own"] < 0.02, aux
    assert aux["recomputed_layers"] == 2 and aux["unproven"] == [2], aux
    assert "[2]" in figures["warnings"][0] and "ids [1] recomputed" in figures["warnings"][0], figures


def test_the_plan_on_real_target_shapes_from_their_config_alone():
    """Llama-3-8B's and -70B's shapes on the meta device (no weights): on the 8B, id 2 fits the budget (embedding,
    4 layers and head: 1.9B) and L//2, L-3 do not; on the 70B the embedding and head alone are past it."""
    llama8b = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    }
    plan = proof.plan_aux(llama8b, [2, 16, 29], 32)
    assert (plan.layers, plan.proven, plan.unproven) == (3, [2], [16, 29]), plan
    llama70b = {**llama8b, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
    plan = proof.plan_aux({**llama70b, "num_attention_heads": 64}, [2, 40, 77], 80)
    assert (plan.layers, plan.proven, plan.unproven) == (None, [], [2, 40, 77]), plan
    assert "embedding, first layer and head hold 2." in plan.reason, plan.reason


def _id_1_off_by_one(s):  # the shallow aux id holds its layer's output
    s[:, 1, :] = s[:, 2, :].clone()
    return s


def test_a_wrong_capture_at_the_proven_id_is_refused_though_the_deep_ones_are_accepted_unproven(
    target, rankings, budget_for_layer_1
):
    folder, samples = target
    with pytest.raises(CaptureError, match=r"layer 1: .*from the one entering layer 2") as err:
        proof.judge(
            {**capture_context(folder), proof.AUX_POLICY: "warn"},
            _captured((target, rankings), _id_1_off_by_one),
            log=print,
        )
    assert "layer 2:" not in str(err.value)  # past the budget: not judged, recorded unproven


def test_preflight_predicts_from_the_config_which_aux_ids_the_proof_can_recompute(target, budget_for_layer_1):
    import json

    folder, _ = target
    cfg = json.loads((folder / "config.json").read_text())
    failures, warnings = proof.aux_refusal(cfg, [1, 2], LAYERS, "refuse")
    assert len(failures) == 1 and not warnings, failures
    assert "aux layer ids [2]" in failures[0] and "(it proves ids [1])" in failures[0], failures
    assert "extraction.unproven_aux_layers: warn" in failures[0] and "shallower extraction.layer_ids" in failures[0]
    failures, warnings = proof.aux_refusal(cfg, [1, 2], LAYERS, "warn")
    assert failures == [] and len(warnings) == 1 and "aux layer ids [2]" in warnings[0], warnings
    assert proof.aux_refusal(cfg, [1], LAYERS, "refuse") == ([], [])  # within the budget: nothing to say
    failures, _ = proof.aux_refusal({**cfg, "quantization_config": {"quant_method": "fp8"}}, [1], LAYERS, "refuse")
    assert "aux layer ids [1]" in failures[0] and "quantized" in failures[0], failures
    failures, _ = proof.aux_refusal({**cfg, "model_type": "no-such-model"}, [1], LAYERS, "refuse")
    assert "transformers cannot read the target's config" in failures[0], failures


def test_too_few_greedy_positions_refuse_rather_than_pass(target, rankings):
    folder, samples = target
    short = [
        (hs[: p + 1], ids[: p + 1], p, r[: p + 1]) for hs, ids, p, r in _captured((target, rankings))
    ]  # one answer token each
    with pytest.raises(CaptureError, match="only 3 greedy positions"):
        proof.judge(capture_context(folder), short, log=lambda m: None)


def test_a_stale_shard_is_refused_though_the_first_shard_was_stale_too(tmp_path, target):
    """Every shard's aux layers are recomputed from the target's weights: a run whose first shard came from
    another capture sets no reference a later shard can pass by matching."""
    from datasets import Dataset

    folder, samples = target
    run = RunFolder(tmp_path / "run")
    source = run.prepare
    rows = [ids for _, _, ids, _ in samples]
    Dataset.from_dict({"input_ids": rows}).save_to_disk(str(source / "dataset"))
    atomic_write_json(run.extract / FOLDER / CONTEXT, capture_context(folder))
    shards = [Shard(0, 0, 1, "a", 0), Shard(1, 1, PROMPTS, "b", 0)]
    sample_path(run.hidden_states, 0).parent.mkdir(parents=True, exist_ok=True)
    for i, (own, _, ids, _) in enumerate(samples):
        stale = _aux_off_by_one(own.clone())  # both shards written by a capture shifted by one layer
        hs = stale[:, CAPTURED, :].to(torch.bfloat16).contiguous()
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(sample_path(run.hidden_states, i)))
    for shard in shards:
        with pytest.raises(CaptureError, match=r"layer 1: .*from the one entering layer 2"):
            check_shard(run.hidden_states, run.shard_manifests / f"{shard.name}.json", source, shard, log=print)
    assert not (run.extract / FOLDER / "baseline.json").exists()
    assert read_json(run.extract / FOLDER / "shard-00001.json")["problems"]


def test_the_proof_prompts_are_the_datas_prompts_within_the_context(tmp_path):
    from datasets import Dataset

    rows = [list(range(10, 10 + n)) for n in (40, 300, 50, 60)]
    masks = [[0] * 12 + [1] * (len(r) - 12) for r in rows]
    Dataset.from_dict({"input_ids": rows, "loss_mask": masks}).save_to_disk(str(tmp_path / "dataset"))
    prompts = proof.proof_prompts(tmp_path, max_model_len=64)
    assert prompts == [rows[0][:12], rows[1][:12], rows[3][:12]]
    masks[1] = [0] * 300
    Dataset.from_dict({"input_ids": rows, "loss_mask": masks}).save_to_disk(str(tmp_path / "d2" / "dataset"))
    long = proof.proof_prompts(tmp_path / "d2", max_model_len=64, rows=4)
    assert len(long[1]) == 64 - proof.ANSWER_TOKENS - 1  # room for the answer and one more


class _Server:
    """The tiny target behind the two requests the proof sends: a greedy completion (the answer's token ids) and
    an extraction (a file in staging, as the connector writes it, with its writer's lock file, and the server's own
    ranking at every position of that forward pass). `corrupt` plants a wrong capture; `flip` makes every other
    greedy token the runner-up, as a decode pass whose numerics order near-ties otherwise than the prefill."""

    def __init__(self, folder, staging, corrupt=None, flip=False):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(folder).eval()
        self.staging, self.corrupt, self.flip, self.base_url, self.greedy = staging, corrupt, flip, "http://fake", 0
        self.session = self

    def post(self, url, json, timeout):
        from types import SimpleNamespace

        assert json["temperature"] == 0.0 and json["ignore_eos"] and json["max_tokens"] == proof.ANSWER_TOKENS
        self.greedy += 1
        ids = list(json["prompt"])
        with torch.no_grad():
            for step in range(json["max_tokens"]):
                order = self.model(torch.tensor([ids])).logits[0, -1].argsort(descending=True)
                ids.append(int(order[1 if self.flip and step % 2 else 0]))
        answer = ids[len(json["prompt"]) :]
        return SimpleNamespace(status_code=200, json=lambda: {"choices": [{"token_ids": answer}]})

    def extract_ranked(self, ids, timeout_s, top_k):
        assert top_k == proof.SERVER_TOP_K
        s = residual_stream(self.model, ids)
        s = self.corrupt(s) if self.corrupt else s
        path = self.staging / f"{len(list(self.staging.iterdir()))}.safetensors"
        save_file(
            {"hidden_states": s[:, CAPTURED, :].to(torch.bfloat16).contiguous(), "token_ids": torch.tensor(ids)},
            str(path),
        )
        (self.staging / (path.name + ".lock")).touch()
        return str(path), server_ranking(self.model, ids)


def _data(tmp_path):
    from datasets import Dataset

    torch.manual_seed(3)
    rows = [torch.randint(3, 256, (20,)).tolist() for _ in range(5)]
    Dataset.from_dict({"input_ids": rows, "loss_mask": [[0] * 8 + [1] * 12] * 5}).save_to_disk(
        str(tmp_path / "data" / "dataset")
    )
    return tmp_path / "data"


def test_the_server_proves_its_capture_once_and_records_it(tmp_path, target):
    from eyrie.stages.extract.proof import prove_server

    folder, _ = target
    staging = tmp_path / "staging"
    staging.mkdir()
    server = _Server(folder, staging)
    state = {"pid": 1, "started_at": 1.0, "ready_at": 2.0, "fingerprint": "f"}
    said: list[str] = []
    figures = prove_server(
        capture_context(folder), _data(tmp_path), tmp_path / "capture", state, server, 128, log=said.append
    )
    assert figures["passed"] and server.greedy == proof.PROOF_ROWS
    recorded = read_json(tmp_path / "capture" / proof.PROOF)
    assert recorded["aux_check"]["relative_l2"]
    head = recorded["head_check"]
    assert head["top1_agreement"] == 1.0 and head["topk_overlap"] >= 0.99 and head["positions"] > 0, head
    assert not list(staging.iterdir())  # each file read back and removed, with its lock
    assert "capture proved in" in said[-1] and f"top-{proof.SERVER_TOP_K} overlap" in said[-1], said[-1]
    prove_server(capture_context(folder), _data(tmp_path), tmp_path / "capture", state, server, 128, log=said.append)
    assert server.greedy == proof.PROOF_ROWS and "already" in said[-1]  # the same server process: not asked again
    prove_server(
        capture_context(folder),
        _data(tmp_path),
        tmp_path / "capture",
        {**state, "pid": 2},
        server,
        128,
        log=said.append,
    )
    assert server.greedy == 2 * proof.PROOF_ROWS  # a new server is proved again


def test_greedy_answers_from_another_pass_do_not_decide_the_verdict(tmp_path, target):
    """Issue 39: the greedy answers come from decode steps, the capture from the extraction's prefill; where the
    two passes order near-ties otherwise, the greedy tokens disagree with the captured states though the capture
    is right. The verdict is the server's own ranking from the capture's forward pass; the greedy agreement is a
    figure."""
    from eyrie.stages.extract.proof import prove_server

    folder, _ = target
    staging = tmp_path / "staging"
    staging.mkdir()
    server = _Server(folder, staging, flip=True)
    said: list[str] = []
    figures = prove_server(
        capture_context(folder), _data(tmp_path), tmp_path / "capture", None, server, 128, log=said.append
    )
    head = read_json(tmp_path / "capture" / proof.PROOF)["head_check"]
    assert figures["passed"] and head["top1_agreement"] == 1.0, head
    assert head["greedy_vs_forward"]["agreement"] < GREEDY_MIN_AGREEMENT, head  # the old rule refused this
    assert f"greedy answers' tokens {head['greedy_vs_forward']['agreement']}" in said[-1], said[-1]


def test_a_server_whose_capture_is_wrong_is_refused_and_recorded(tmp_path, target):
    from eyrie.stages.extract.proof import prove_server

    folder, _ = target
    staging = tmp_path / "staging"
    staging.mkdir()
    server = _Server(folder, staging, _aux_off_by_one)
    with pytest.raises(CaptureError, match="layer 1: "):
        prove_server(
            capture_context(folder), _data(tmp_path), tmp_path / "capture", None, server, 128, log=lambda m: None
        )
    recorded = read_json(tmp_path / "capture" / proof.PROOF)
    assert recorded["passed"] is False and "layer 1: " in recorded["reason"]


def test_layers_that_carry_recurrent_state_are_recognised_from_the_config():
    class Plain:  # a model class with none of vLLM's state flags
        pass

    assert proof.recurrent_state(Plain, {"layer_types": ["full_attention", "sliding_attention"] * 2}) is None
    assert proof.recurrent_state(Plain, {}) is None
    gated = proof.recurrent_state(Plain, {"layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    assert gated and "3 of its 4 layers" in gated
    assert proof.recurrent_state(Plain, {"layer_types": ["conv", "full_attention"]})  # short convolutions
    assert proof.recurrent_state(Plain, {"layer_types": ["mamba", "attention"]})  # a legacy name, remapped


def test_a_hybrid_target_is_refused_before_the_load_unless_the_proof_is_to_decide():
    """vLLM's own interfaces on its real classes: state-space, short-convolution and gated-linear-attention hybrids
    are recognised; attention-only targets are not."""
    from eyrie.stages.preflight.target import resolve_vllm_class

    for arch in ("Qwen3NextForCausalLM", "Lfm2ForCausalLM", "MambaForCausalLM"):
        assert proof.recurrent_state(resolve_vllm_class(arch), {}), arch
    for arch in ("LlamaForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM"):
        assert proof.recurrent_state(resolve_vllm_class(arch), {}) is None, arch
    refused = proof.recurrent_state_refusal(resolve_vllm_class("Qwen3NextForCausalLM"), {})
    assert refused and "carry recurrent state" in refused[0] and "target.recurrent_layers: prove" in refused[0]
    assert proof.recurrent_state_refusal(resolve_vllm_class("LlamaForCausalLM"), {}) == []
    assert proof.recurrent_state_refusal(resolve_vllm_class("Qwen3NextForCausalLM"), {}, "prove") == []


def test_the_stage_proves_each_server_before_its_first_shard_and_a_refusal_stops_it(monkeypatch):
    """flows/extract.py's wiring (regeneration's too): the proof runs once per server URL, before any shard is
    submitted; a refusal stops the server (unless the config keeps it) and no shard is submitted."""
    from types import SimpleNamespace

    from flows import extract

    proved, submitted, stopped = [], [], []
    plan = SimpleNamespace(server_dir="/srv", spec=SimpleNamespace(max_model_len=64))
    run = SimpleNamespace(root="/run")
    server = SimpleNamespace(stop=lambda: stopped.append(1))
    monkeypatch.setattr(extract, "prove_capture_task", lambda *a: proved.append(a[-1]) or {"passed": True})
    figures: dict = {}
    submit = extract.proved_first(
        lambda todo, url: submitted.append((todo, url)), None, {}, run, "/src", plan, server, False, figures
    )
    submit(["a"], "http://one")
    submit(["b"], "http://one")  # the same server: not proved again
    submit(["c"], "http://two")  # restarted: a new server is proved
    assert proved == ["http://one", "http://two"] and figures == {"passed": True}
    assert submitted == [(["a"], "http://one"), (["b"], "http://one"), (["c"], "http://two")]

    def refuse(*a):
        raise CaptureError("layer 2: not the target's")

    monkeypatch.setattr(extract, "prove_capture_task", refuse)
    submitted.clear()
    submit = extract.proved_first(
        lambda todo, url: submitted.append(todo), None, {}, run, "/src", plan, server, False, {}
    )
    with pytest.raises(CaptureError, match="layer 2"):
        submit(["a"], "http://three")
    assert submitted == [] and stopped == [1]
    kept = extract.proved_first(lambda todo, url: None, None, {}, run, "/src", plan, server, True, {})
    with pytest.raises(CaptureError):
        kept(["a"], "http://four")
    assert stopped == [1]  # extraction.keep_server_after_failure: left up
