"""Eyrie: raise EAGLE-3 drafters for vLLM-served targets.

The core library: plain Python over paths and pydantic configs. It never imports Prefect; tasks/ and flows/ wire it.
"""

__version__ = "0.1.0"
# Bumped whenever a stage's on-disk output changes meaning; part of every cache key and run-folder stamp.
FORMAT_VERSION = 1
