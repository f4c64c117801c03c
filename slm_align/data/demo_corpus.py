"""The built-in corpus: short, simple stories generated from a seed.

Small vocabulary, clear structure (setting, event, feeling, resolution, lesson) so that a model of a
few million parameters becomes fluent on it in minutes on a CPU. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam", "Ella", "Jack",
         "Lucy", "Tim", "Nina", "Finn", "Rosa", "Omar", "Ivy", "Noah"]
ANIMALS = ["cat", "dog", "bunny", "bird", "fox", "bear", "duck", "frog", "mouse", "owl"]
KIDS = ["girl", "boy"]
ADJECTIVES = ["little", "happy", "small", "kind", "brave", "curious", "shy", "funny"]
PLACES = ["a small house", "a big forest",
          "a quiet town", "a sunny farm", "a green park", "a little village"]
COLORS = ["red", "blue", "yellow", "green", "pink", "shiny"]
OBJECTS = ["ball", "kite", "box", "hat", "book", "cup", "boat", "toy car",
           "flower", "key", "shell", "stone",
           "drum", "map", "bell", "sock"]
FRIENDS = ["mom", "dad", "a friend", "grandma", "a neighbor", "a teacher"]
FIND_PLACES = ["under a tree", "near the river", "in the garden", "behind the door", "on the path"]
TROUBLES = [
    ("the wind blew it away", "ran after it"),
    ("it fell into the water", "asked for help"),
    ("it got stuck in a tree", "climbed up carefully"),
    ("a dog took it", "followed the dog"),
    ("it broke into two pieces", "fixed it with glue"),
]
FEELINGS = [("happy", "smiled"), ("excited", "jumped up and down"), ("surprised", "gasped")]
LESSONS = [
    "sharing makes everyone happy",
    "it is good to ask for help",
    "being patient is important",
    "friends make every day better",
    "it is kind to help others",
    "you should never give up",
]
PLAYS = ["played with it all day", "took it home", "showed it to everyone", "kept it safe",
         "put it in a bag", "sang a song about it"]
WEATHER = ["The sun was warm.",
           "It was a rainy day.", "The sky was blue and clear.", "It was cold and windy.",
           "Snow was falling softly."]
SAYINGS = ["Look at this!", "What a nice day!",
           "I love it!", "Can you help me?", "This is the best day ever!"]


def _pronoun(kind: str, rng: random.Random) -> tuple[str, str]:
    if kind == "girl":
        return "She", "her"
    if kind == "boy":
        return "He", "his"
    return rng.choice([("She", "her"), ("He", "his")])


def generate_story(rng: random.Random) -> str:
    """One story of six to eleven sentences."""
    name = rng.choice(NAMES)
    kind = rng.choice(KIDS + ANIMALS)
    subj, poss = _pronoun(kind, rng)
    obj = rng.choice(OBJECTS)
    color = rng.choice(COLORS)
    feeling, gesture = rng.choice(FEELINGS)
    trouble, fix = rng.choice(TROUBLES)
    friend = rng.choice(FRIENDS)
    sentences = [
        f"Once upon a time, there was a {rng.choice(ADJECTIVES)} {kind} named {name}.",
        f"{subj} lived in {rng.choice(PLACES)}.",
    ]
    if rng.random() < 0.5:
        sentences.append(rng.choice(WEATHER))
    sentences += [
        f"One day, {name} found a {color} {obj} {rng.choice(FIND_PLACES)}.",
        f"{name} was very {feeling} and {gesture}.",
        f"{subj} {rng.choice(PLAYS)}.",
    ]
    if rng.random() < 0.5:
        sentences.append(f'"{rng.choice(SAYINGS)}" said {name}.')
    if rng.random() < 0.7:
        sentences += [
            f"But then {trouble}.",
            f"{name} was sad, so {subj.lower()} {fix}.",
            f"With help from {friend}, {name} got {poss} {obj} back.",
        ]
    else:
        sentences.append(f"{name} gave the {obj} to {friend}, and they both smiled.")
    sentences.append(f"In the end, {name} learned that {rng.choice(LESSONS)}.")
    return " ".join(sentences)


def generate_stories(n: int, seed: int = 0) -> list[str]:
    """``n`` stories, identical for the same ``(n, seed)``."""
    rng = random.Random(seed)
    return [generate_story(rng) for _ in range(n)]


def write_demo_corpus(path: Path, n: int, seed: int = 0) -> Path:
    """Write ``n`` stories as a ``.txt`` corpus (blank line between documents)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(generate_stories(n, seed)) + "\n", encoding="utf-8")
    return path
