"""Regenerate ``builtin.txt``, the corpus shipped with elastimesh for runs with ``data.path = "builtin"``.

The text is synthetic English produced by a small seeded grammar over hand-written word lists, so it is
free of copyright, needs no download, and is byte-for-byte reproducible: running this script again must
give the committed file (``python meshdata/corpus/make_builtin.py --check`` verifies that).

The grammar is deliberately structured rather than random word salad, so a small byte-level GPT has
something to learn at every scale: spelling (fixed words), agreement (singular/plural subjects pick the
verb form), phrase structure (determiner -> adjective -> noun), topic coherence (each paragraph keeps a
cast of characters and a place), and punctuation/paragraph layout.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

SEED = 20240611
TARGET_BYTES = 450_000
OUT = Path(__file__).with_name("builtin.txt")

NAMES = ["Ada", "Bram", "Cora", "Dev", "Elin", "Farid", "Greta", "Hugo", "Iris", "Jonas", "Kira", "Leo",
         "Mira", "Nils", "Olga", "Pavel", "Rosa", "Sami", "Tova", "Ulric", "Vera", "Wren", "Yusuf", "Zoe"]
# (singular, plural) pairs so the verb agreement below is learnable.
NOUNS = [("baker", "bakers"), ("sailor", "sailors"), ("farmer", "farmers"), ("child", "children"),
         ("teacher", "teachers"), ("miner", "miners"), ("painter", "painters"), ("doctor", "doctors"),
         ("fox", "foxes"), ("horse", "horses"), ("crow", "crows"), ("dog", "dogs"), ("cat", "cats"),
         ("merchant", "merchants"), ("weaver", "weavers"), ("guard", "guards"), ("clerk", "clerks")]
THINGS = ["lamp", "letter", "basket", "map", "key", "boat", "bridge", "garden", "clock", "wagon",
          "bell", "coat", "cup", "bucket", "ladder", "window", "book", "kettle", "rope", "box"]
PLACES = ["the harbour", "the market", "the old mill", "the village square", "the river bank",
          "the north road", "the bakery", "the school", "the lighthouse", "the orchard", "the station",
          "the hill above the town", "the quiet library", "the forest edge", "the workshop"]
ADJS = ["old", "small", "red", "quiet", "heavy", "bright", "wooden", "broken", "green", "warm", "cold",
        "tall", "narrow", "golden", "dusty", "new", "strange", "gentle", "loud", "careful"]
# (third person singular, plural/base, past) forms for transitive verbs.
VERBS = [("carries", "carry", "carried"), ("finds", "find", "found"), ("opens", "open", "opened"),
         ("mends", "mend", "mended"), ("paints", "paint", "painted"), ("sells", "sell", "sold"),
         ("watches", "watch", "watched"), ("cleans", "clean", "cleaned"), ("builds", "build", "built"),
         ("loses", "lose", "lost"), ("gives away", "give away", "gave away"), ("hides", "hide", "hid")]
INTRANS = [("walks", "walk", "walked"), ("sings", "sing", "sang"), ("waits", "wait", "waited"),
           ("sleeps", "sleep", "slept"), ("laughs", "laugh", "laughed"), ("works", "work", "worked"),
           ("rests", "rest", "rested"), ("listens", "listen", "listened")]
TIMES = ["in the morning", "at noon", "before dinner", "after the rain", "every Sunday", "at dawn",
         "late at night", "in the spring", "when the bell rings", "on market day"]
WEATHER = ["The wind was cold", "The sky was grey", "The sun was warm", "Rain fell all day",
           "Snow covered the roofs", "A fog came in from the sea", "The air smelled of salt"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve"]
CONNECT = ["Then", "Later", "After that", "Meanwhile", "So", "Soon", "At last", "Still"]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class Writer:
    """Writes one paragraph at a time about a fixed cast, so nearby sentences share names and places."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def np_thing(self) -> str:
        t = self.r.choice(THINGS)
        if self.r.random() < 0.5:
            t = f"{self.r.choice(ADJS)} {t}"
        return f"the {t}" if self.r.random() < 0.67 else _a(t)

    def subject(self, cast: list[str]) -> tuple[str, bool]:
        """Returns (subject phrase, is_plural)."""
        x = self.r.random()
        if x < 0.45:
            return self.r.choice(cast), False
        if x < 0.6:
            a, b = self.r.sample(cast, 2)
            return f"{a} and {b}", True
        sing, plur = self.r.choice(NOUNS)
        if self.r.random() < 0.5:
            return f"the {self.r.choice(ADJS)} {sing}", False
        return f"the {plur}", True

    def sentence(self, cast: list[str], place: str, past: bool) -> str:
        subj, plural = self.subject(cast)
        form = 2 if past else (1 if plural else 0)
        kind = self.r.random()
        if kind < 0.45:
            v = self.r.choice(VERBS)[form]
            s = f"{subj} {v} {self.np_thing()}"
            if self.r.random() < 0.5:
                s += f" at {place}" if place.startswith("the ") else f" in {place}"
        elif kind < 0.65:
            v = self.r.choice(INTRANS)[form]
            s = f"{subj} {v} {self.r.choice(TIMES)}"
        elif kind < 0.78:
            be = "were" if (past and plural) else "was" if past else "are" if plural else "is"
            s = f"{subj} {be} {self.r.choice(ADJS)}"
        elif kind < 0.9:
            n = self.r.randrange(2, 13)
            thing = self.r.choice(THINGS)
            plural_thing = thing + ("es" if thing.endswith(("x", "ch", "sh")) else "s")
            v = "had" if past else ("have" if plural else "has")
            s = f"{subj} {v} {NUMBERS[n - 1]} {plural_thing}"
        else:
            name = self.r.choice(cast)
            said = "said" if past else "says"
            quote = self.sentence(cast, place, past=False)
            return f'"{quote[:-1]}," {said} {name}.'
        if self.r.random() < 0.2:
            s = f"{self.r.choice(CONNECT)} {s}" if past else s
        s = s[0].upper() + s[1:]
        if self.r.random() < 0.15:
            s += f", because {self.r.choice(cast)} {'asked' if past else 'asks'}"
        return s + "."

    def paragraph(self) -> str:
        cast = self.r.sample(NAMES, 3)
        place = self.r.choice(PLACES)
        past = self.r.random() < 0.6
        out = []
        if past:
            out.append(f"{self.r.choice(WEATHER)} when {cast[0]} came to {place}.")
        else:
            out.append(f"This is a story about {cast[0]}, who lives near {place}.")
        out.extend(self.sentence(cast, place, past) for _ in range(self.r.randrange(3, 9)))
        return " ".join(out)


def generate(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    w = Writer(random.Random(seed))
    parts: list[str] = []
    size = 0
    chapter = 0
    while size < target_bytes:
        # Chapter headings give long-range structure (increasing numbers) at a regular rhythm.
        if len(parts) % 25 == 0:
            chapter += 1
            heading = f"Chapter {chapter}"
            parts.append(heading)
            size += len(heading) + 2
        p = w.paragraph()
        parts.append(p)
        size += len(p) + 2
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="verify the committed file instead of writing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = generate()
    data = text.encode("ascii")  # ASCII only, so byte tokens == characters
    if args.check:
        ok = args.out.exists() and args.out.read_bytes() == data
        sys.stderr.write(("ok" if ok else f"{args.out} differs from the generator output") + "\n")
        return 0 if ok else 1
    args.out.write_bytes(data)
    sys.stderr.write(f"wrote {args.out} ({len(data)} bytes)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
