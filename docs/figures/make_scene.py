"""Draws docs/figures/scene.png, the test picture of the README's `ficoco show` figure (made
here, not downloaded): a sky, a sun, hills and a house, so that kept and merged tokens can be
told apart by region."""

from PIL import Image, ImageDraw

WIDTH, HEIGHT = 448, 336
picture = Image.new("RGB", (WIDTH, HEIGHT))
draw = ImageDraw.Draw(picture)
for y in range(HEIGHT):  # sky: light blue fading to white at the horizon
    shade = int(150 + 100 * y / HEIGHT)
    draw.line([(0, y), (WIDTH, y)], fill=(shade - 60, shade - 20, 255))
draw.ellipse((330, 30, 400, 100), fill=(255, 210, 60))
draw.polygon([(0, 230), (120, 170), (260, 220), (448, 160), (448, 336), (0, 336)], fill=(70, 150, 60))
draw.rectangle((150, 190, 260, 280), fill=(200, 80, 60))
draw.polygon([(140, 190), (205, 140), (270, 190)], fill=(110, 50, 40))
draw.rectangle((190, 235, 220, 280), fill=(80, 50, 30))
picture.save("docs/figures/scene.png")
