"""prepare: conversations -> token ids with the target's chat template, an assistant-only loss mask, a shard plan.

Output (speculators' preprocessed format, so its tools read it): `dataset/` saved with `datasets.save_to_disk`
(columns input_ids, loss_mask, seq_len; torch format) with `dataset/token_freq.pt` (loss-masked token counts), plus
Eyrie's `shards.json` (the extraction plan, a content fingerprint per shard), `conversations.jsonl` (the train
conversations, row-aligned with the dataset, for the regenerate stage), `eval_prompts.jsonl` (held-out
conversations for evaluation) and `stats.json` (rows used and dropped by reason). No model weights are loaded.

The package, by job: `source` (reading rows, the source's fingerprint), `conversation` (roles, the chat template,
the loss mask), `rows` (a row that cannot be used; the row tally regeneration's shards keep too), `plan` (the
held-out split, the shard plan), `key` (the stage's key and its remembered fingerprints), `dataset` (the dataset
written and read back), `stage` (`prepare` itself).
"""

from eyrie.stages.prepare.conversation import ROLE_ALIASES, _render, normalize, render_text, tokenize_conversation
from eyrie.stages.prepare.dataset import _save_dataset, iter_eval_prompts, load_dataset_rows, load_seq_lens
from eyrie.stages.prepare.key import prepare_key, remembered_tokenizer_fingerprint, tokenizer_fingerprint
from eyrie.stages.prepare.plan import Shard, is_eval, load_shards, plan_shards
from eyrie.stages.prepare.rows import RowError
from eyrie.stages.prepare.source import LOCAL_SUFFIXES, is_hub_source, iter_rows, source_fingerprint
from eyrie.stages.prepare.stage import PrepareStats, prepare

__all__ = [
    "LOCAL_SUFFIXES",
    "ROLE_ALIASES",
    "PrepareStats",
    "RowError",
    "Shard",
    "_render",
    "_save_dataset",
    "is_eval",
    "is_hub_source",
    "iter_eval_prompts",
    "iter_rows",
    "load_dataset_rows",
    "load_seq_lens",
    "load_shards",
    "normalize",
    "plan_shards",
    "prepare",
    "prepare_key",
    "remembered_tokenizer_fingerprint",
    "render_text",
    "source_fingerprint",
    "tokenize_conversation",
    "tokenizer_fingerprint",
]
