"""Issue 25 item 7: the draft-token sweep emits, beside its table and plot, the schedule vLLM takes
(`num_speculative_tokens_per_batch_size`): the best k at each measured concurrency, checked by the installed vLLM's
own schedule parser."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from eyrie.stages.evaluate import (
    SCHEDULE_FIELD,
    batch_size_schedule,
    best_k_per_concurrency,
    throughput_rows,
    vllm_has_batch_size_schedule,
)


def _vllm_schedule_parser():
    """vLLM's own dynamic-speculative-decoding schedule module, loaded from its file (it imports nothing; the vllm
    package's import takes tens of seconds)."""
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "v1" / "spec_decode" / "dynamic" / "utils.py"
    loaded = importlib.util.spec_from_file_location("vllm_dynamic_sd_utils", path)
    assert loaded and loaded.loader
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def _rows():
    alone = [{"concurrency": c, "output_tokens_per_s": v} for c, v in ((1, 100.0), (8, 400.0), (32, 900.0))]
    k3 = [{"concurrency": c, "output_tokens_per_s": v} for c, v in ((1, 180.0), (8, 520.0), (32, 850.0))]
    k5 = [{"concurrency": c, "output_tokens_per_s": v} for c, v in ((1, 210.0), (8, 500.0), (32, 700.0))]
    return throughput_rows(alone, {3: k3, 5: k5})


def test_the_best_k_per_concurrency_becomes_the_schedule_vllm_takes():
    rows = _rows()
    assert [(b["concurrency"], b["best_k"]) for b in best_k_per_concurrency(rows)] == [(1, 5), (8, 3), (32, 0)]
    assert vllm_has_batch_size_schedule()  # the installed vLLM (0.32) has the field
    schedule = batch_size_schedule(rows, "/promo/current")
    ranges = schedule[SCHEDULE_FIELD]
    assert ranges == [[1, 7, 5], [8, 31, 3], [32, 32, 0]]
    config = schedule["speculative_config"]
    assert config["method"] == "eagle3" and config["model"] == "/promo/current"
    assert config["num_speculative_tokens"] == 5 and config[SCHEDULE_FIELD] == ranges
    # vLLM's own parser takes it, and maps every batch size to the best k measured at or below it.
    vllm = _vllm_schedule_parser()
    assert vllm.validate_and_normalize_dynamic_sd_schedule(ranges) == [tuple(r) for r in ranges]
    dense = vllm.build_dynamic_sd_schedule_lookup(ranges, 64, config["num_speculative_tokens"])
    assert dense[1] == dense[7] == 5 and dense[8] == dense[31] == 3 and dense[32] == dense[64] == 0


def test_one_best_k_is_one_range_and_a_vllm_without_the_field_gets_a_fixed_k():
    alone = [{"concurrency": c, "output_tokens_per_s": 100.0} for c in (1, 4)]
    k3 = [{"concurrency": c, "output_tokens_per_s": 200.0} for c in (1, 4)]
    rows = throughput_rows(alone, {3: k3})
    schedule = batch_size_schedule(rows, "/d", has_field=True)
    assert schedule[SCHEDULE_FIELD] == [[1, 4, 3]]
    old = batch_size_schedule(_rows(), "/d", has_field=False)
    assert SCHEDULE_FIELD not in old and SCHEDULE_FIELD not in old["speculative_config"]
    assert old["speculative_config"]["num_speculative_tokens"] == 5  # the best at the lowest concurrency
    assert "takes no num_speculative_tokens_per_batch_size" in old["note"]
    assert [b["best_k"] for b in old["best_k"]] == [5, 3, 0]  # still given, per concurrency
    slower = batch_size_schedule(throughput_rows(k3, {3: alone}), "/d", has_field=True)
    assert slower["speculative_config"] is None and "without the drafter" in slower["note"]
