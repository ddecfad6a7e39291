"""Writes src/dispatch_amp/data/corpus.txt, the demo's training text.

The text is generated from a small grammar with a fixed seed, so it is free of any
licence and the same on every machine: short sentences about travellers, rivers and
towns, with enough structure (agreement, repeated names, punctuation) for a character
model to learn in a minute. Run: python scripts/make_demo_corpus.py
"""

import pathlib
import random

NAMES = ["Ada", "Bram", "Cleo", "Dov", "Esme", "Finn", "Greta", "Hugo", "Iris", "Jonah",
         "Kira", "Lars", "Mina", "Nils", "Oona", "Pavel"]
PLACES = ["the old mill", "the river bank", "the market", "the north road", "the harbour",
          "the orchard", "the hill fort", "the quiet inn", "the stone bridge", "the forest"]
THINGS = ["a lantern", "a map", "a loaf of bread", "a letter", "a small boat", "a basket of apples",
          "a silver key", "a wool coat", "a jar of honey", "a wooden flute"]
ADJ = ["cold", "bright", "narrow", "busy", "silent", "green", "grey", "warm", "long", "early"]
TIMES = ["at dawn", "before noon", "in the evening", "after the rain", "at night", "on market day"]
VERBS_PAST = ["walked to", "rowed to", "waited at", "searched", "painted", "left", "reached", "crossed"]
CARRY = ["carried", "found", "sold", "mended", "lost", "bought", "hid", "shared"]


def sentence(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{a} {rng.choice(VERBS_PAST)} {rng.choice(PLACES)} {rng.choice(TIMES)}."
    if kind == 1:
        return f"{a} {rng.choice(CARRY)} {rng.choice(THINGS)} for {b}."
    if kind == 2:
        return f"The road to {rng.choice(PLACES)[4:]} was {rng.choice(ADJ)} and {rng.choice(ADJ)}."
    if kind == 3:
        return f'"Where is {rng.choice(THINGS)}?" asked {a}. "At {rng.choice(PLACES)}," said {b}.'
    if kind == 4:
        n = rng.randrange(2, 12)
        return f"{a} counted {n} boats and {n + rng.randrange(1, 9)} gulls {rng.choice(TIMES)}."
    return f"When {a} {rng.choice(VERBS_PAST)} {rng.choice(PLACES)}, {b} {rng.choice(CARRY)} {rng.choice(THINGS)}."


def corpus(chars: int = 150_000, seed: int = 0) -> str:
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < chars:
        paragraph = " ".join(sentence(rng) for _ in range(rng.randrange(3, 7)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parents[1] / "src" / "dispatch_amp" / "data" / "corpus.txt"
    out.write_text(corpus())
    print(f"wrote {out} ({out.stat().st_size} bytes)")
