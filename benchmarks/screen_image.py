"""Write a deterministic screenshot-like test image: flat panels, bars and a few textured tiles.

PixelPrune keeps one patch of every run of identical patches (its count is decided by the pixels), so on the
random pixels of `ficoco profile`'s default input it keeps every patch. A screen or document page is mostly flat;
this image stands in for one, made from a seed (nothing is downloaded):

    python benchmarks/screen_image.py reports/methods-2026/screen-768.png --size 768
    ficoco profile -m qwen3-vl-8b --variant vanilla,pixelprune --image reports/methods-2026/screen-768.png ...
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw


def screen_image(size: int, seed: int = 0) -> Image.Image:
    """A `size` x `size` RGB image: a flat background, a title bar, flat panels, and textured tiles (about a
    fifth of the area) where no two neighbouring patches are alike."""
    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), (246, 246, 248))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, size, size // 12), fill=(40, 60, 110))
    unit = size // 8
    for row in range(1, 8):
        for col in range(8):
            if rng.random() < 0.35:
                colour = tuple(rng.randrange(80, 230) for _ in range(3))
                draw.rectangle((col * unit, row * unit, (col + 1) * unit - 1, (row + 1) * unit - 1), fill=colour)
            elif rng.random() < 0.3:  # a textured tile: text-like noise
                for y in range(row * unit, (row + 1) * unit, 2):
                    for x in range(col * unit, (col + 1) * unit, 3):
                        shade = rng.randrange(0, 256)
                        draw.rectangle((x, y, x + 2, y + 1), fill=(shade, shade, shade))
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--size", type=int, default=768)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    screen_image(args.size, args.seed).save(args.path)
    print(f"wrote {args.path} ({args.size} x {args.size})")


if __name__ == "__main__":
    main()
