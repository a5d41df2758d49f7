"""Chat prompts shared by the language service test and its encoder peer process: the same
index gives the same processor inputs (and so the same payload) in both processes."""

from __future__ import annotations

SIZES = [(28, 28), (56, 84), (112, 56), (84, 140)]


def make_inputs(oracle, processor, i: int) -> dict:
    """Prompt i: i % 4 images (0-3) of different sizes, text growing with i."""
    images = [oracle.make_image(10 * i + j, SIZES[(i + j) % 4]) for j in range(i % 4)]
    text = f"prompt {i}: describe these " + "words " * (3 * i)
    return oracle.make_inputs(processor, text, images)
