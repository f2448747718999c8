"""The bundled demo conversations: small, deterministic and regular enough that a tiny target learns them.

The demo target is trained on these (so its outputs are predictable and a drafter has something to learn);
`python -m eyrie.target.tiny.demo_data` rewrites eyrie/data/demo_chat.jsonl byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_DATA = Path(__file__).parent / "data" / "demo_chat.jsonl"

_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "eagle",
    "tiger",
    "maple",
    "ocean",
    "amber",
    "piano",
    "lemon",
    "tulip",
    "cedar",
    "falcon",
    "harbor",
    "meadow",
    "silver",
    "window",
    "garden",
    "candle",
]
_COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _count(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(1, 30)
    b = a + rng.randint(3, 9)
    return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def _spell(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(_WORDS)
    return f"Spell the word {w}.", f"The word {w} is spelled " + "-".join(w) + "."


def _repeat(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(_WORDS, 3)
    phrase = " ".join(words)
    return f"Repeat after me: {phrase}", f"Sure. {phrase}. {phrase}."


def _colors(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(2, 5)
    picked = rng.sample(_COLORS, n)
    return (f"Name {_NUMBER_WORDS[n]} colors.", f"Here are {_NUMBER_WORDS[n]} colors: " + ", ".join(picked) + ".")


_KINDS = [_count, _add, _spell, _repeat, _colors]


def conversations(n: int = 800, seed: int = 0) -> list[dict]:
    """n conversations in OpenAI `messages` form; about one in four has two user turns."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You are a helpful assistant."})
        for _ in range(2 if rng.random() < 0.25 else 1):
            question, answer = rng.choice(_KINDS)(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"id": f"demo-{i:04d}", "messages": messages})
    return out


def corpus_text(rows: list[dict]) -> list[str]:
    return [m["content"] for row in rows for m in row["messages"]]


def write(path: Path = DEMO_DATA) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in conversations()))
    return path


if __name__ == "__main__":
    print(write())
