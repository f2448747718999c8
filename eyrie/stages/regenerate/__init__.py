"""regenerate: the target rewrites every assistant turn of the prepared conversations (on-policy data).

Turn by turn, the user (and system, tool) turns kept: each turn's prompt is built as token ids, the chat template's
render of the conversation so far in which every earlier assistant turn is the target's own answer, as the ids the
server produced. The prompt goes to vLLM's /v1/completions as ids; the ids it returns are appended verbatim, so
extraction and training see exactly the tokens the target generated, never a decode and re-tokenization of them.
The loss mask covers exactly those generated ids, the end-of-turn token included when the target emitted it; the
template's text around a turn (the newline after `<|im_end|>`, the next user turn, the next generation prompt) is
context.

The template's pieces come from renders of a skeleton conversation whose regenerated answers are sentinels: the
text between one answer and the next generation prompt is what follows that answer's sentinel. Where the template
writes a turn's header in history otherwise than in its generation prompt (a `<think></think>` placeholder), the
row keeps what was sent and generated (see `plan_turns`). A template that rewrites earlier turns once later ones
exist cannot give one row its ids (`template_rewrites_history`).

The stage runs on the extraction server (one target load for both stages, see README): its requests carry Eyrie's
per-request switch that keeps the hidden-states connector from writing a file for them, and a cache salt, so
extraction's prefix cache never serves blocks a regeneration request computed.

Output (prepare's format, so extraction, vocab and train read it through the same functions): `dataset/`
(input_ids, loss_mask, seq_len) with `dataset/token_freq.pt`, `shards.json` (one output shard per prepared shard,
its rows those that regenerated), `stats.json`, `manifest.json`; per shard `shards/shard-*.parquet` and its manifest
`shards/shard-*.json` written last. Held-out evaluation conversations are prepare's and never reach this stage.

Modules, one job each:

- `plan`: the shard keys and the plan (which shards are pending, the server);
- `shard`: one shard's requests, its rows and manifest (`regenerate_shard`);
- `window`: the requests to one server (one loop, one session, its slots), shared by the shards regenerating from it
  at the same time;
- `conversation`: one conversation's template pieces, sampling and turn loop;
- `assemble`: the shards as one dataset;
- `source`: which folder extraction reads, and `eyrie status`'s line.

Import from the modules. The package re-exports only what callers outside it still import from it (status, verify,
the fan-out, the pipeline, benchmarks).
"""

from eyrie.stages.regenerate.conversation import shared_tokenizer
from eyrie.stages.regenerate.plan import RegenerationPlan
from eyrie.stages.regenerate.shard import regenerate_shard, shard_paths
from eyrie.stages.regenerate.source import extraction_source, stage_status

__all__ = [
    "RegenerationPlan",
    "extraction_source",
    "regenerate_shard",
    "shard_paths",
    "shared_tokenizer",
    "stage_status",
]
