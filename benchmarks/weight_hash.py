"""A weight file's identity by its whole content (`eyrie.run.identity.file_digest`): the first hash of a multi-GB
file, the cached lookup of the same file version in a new process (the digest store), and the read rate.

    .venv/bin/python benchmarks/weight_hash.py [--gib 4]

The file is written under the repository's ignored .cache/ (random data, so no compression or sparse file helps),
dropped from the page cache where the kernel allows it (posix_fadvise DONTNEED after an fsync), hashed, then looked
up again by a fresh Python process with the same digest store. Prints one JSON line; the file is removed after."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOOKUP = """
import sys, time
from pathlib import Path
t = time.perf_counter()
from eyrie.run.identity import file_digest
digest = file_digest(Path(sys.argv[1]))
print(digest, time.perf_counter() - t)
"""


def write_random(path: Path, gib: float) -> None:
    block = os.urandom(64 << 20)
    left = int(gib * (1 << 30))
    with open(path, "wb") as f:
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            block = block[1:] + block[:1]  # each block differs
            left -= n
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the first hash reads from disk where it can
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.0)
    args = parser.parse_args()
    cache = ROOT / ".cache"
    cache.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="weight-hash-") as tmp:
        os.environ["EYRIE_DIGEST_STORE"] = str(Path(tmp) / "digests")
        path = Path(tmp) / "model-00001.safetensors"
        write_random(path, args.gib)
        from eyrie.run.identity import file_digest, hash_algorithm

        t = time.perf_counter()
        digest = file_digest(path)
        first = time.perf_counter() - t
        out = subprocess.run(
            [sys.executable, "-c", LOOKUP, str(path)], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.split()
        assert out[0] == digest, (out, digest)
        size = path.stat().st_size
        print(
            json.dumps(
                {
                    "bytes": size,
                    "algorithm": hash_algorithm(),
                    "first_hash_s": round(first, 2),
                    "gb_per_s": round(size / first / 1e9, 2),
                    "cached_lookup_new_process_s": round(float(out[1]), 4),  # import of eyrie.run.identity included
                    "cpus": os.cpu_count(),
                }
            )
        )


if __name__ == "__main__":
    main()
