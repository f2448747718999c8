"""Eyrie: raise EAGLE-3 drafters for vLLM-served targets.

The core library: plain Python over paths and pydantic configs. It never imports Prefect; tasks/ and flows/ wire it.
"""

__version__ = "0.1.0"
# The run folder's one format stamp: bumped whenever a stage's on-disk output or a key's recipe changes meaning; part of
# every key (eyrie.run.identity) and of the folder's stamp, which refuses a folder of another format, saying what to do.
# 2: every key computed from one declaration (eyrie.run.identity).
FORMAT_VERSION = 2
