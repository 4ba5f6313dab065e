"""Reading back what a run wrote for people: metric series, the curves PNG."""

from __future__ import annotations

from pathlib import Path


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def decode_png(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        image.load()  # a truncated or corrupt PNG raises here
        assert image.format == "PNG"
        extrema = image.convert("L").getextrema()
        assert extrema[0] < extrema[1], "the image is blank"
        return image.size
