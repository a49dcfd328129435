"""A small plotter that writes PNG without any plotting library (zlib + struct only).

`plot_png(panels, ...)` draws side-by-side panels and returns the PNG bytes:
- `CdfPanel`: empirical CDFs of some series (one coloured line each, with a legend);
- `BarPanel`: one bar per label.
Axes have tick marks labelled with a built-in 3x5 pixel font (digits, A-Z, a few signs;
lower case is drawn as upper case). `encode_png(width, height, rgb)` is the bare encoder.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GREY: Color = (150, 150, 150)
LIGHT_GREY: Color = (225, 225, 225)
PALETTE: list[Color] = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189)]

# Each glyph: five rows of three bits, the top row first (digit 7 = all three set).
_GLYPHS = (
    "0:75557 1:26227 2:71747 3:71717 4:55711 5:74717 6:74757 7:71122 8:75757 9:75717 "
    "A:25755 B:65656 C:34443 D:65556 E:74647 F:74644 G:34553 H:55755 I:72227 J:11152 "
    "K:55655 L:44447 M:57755 N:65555 O:25552 P:65644 Q:25563 R:65655 S:34216 T:72222 "
    "U:55557 V:55552 W:55775 X:55255 Y:55222 Z:71247 .:00002 -:00700 /:11244 %:51245 "
    "(:12221 ):42224 =:07070 _:00007 +:02720 ::02020 ,:00024"
)
FONT: dict[str, tuple[int, ...]] = {g[0]: tuple(int(d) for d in g[2:]) for g in _GLYPHS.split()}
GLYPH_W, GLYPH_H = 3, 5


@dataclass
class CdfPanel:
    title: str
    series: dict[str, list[float]]  # label: values; each becomes one CDF line


@dataclass
class BarPanel:
    title: str
    bars: list[tuple[str, float]]  # (label, value)
    colors: list[Color] = field(default_factory=list)  # per bar; default the first palette colour


Panel = CdfPanel | BarPanel


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of `rgb` (rows top to bottom, 3 bytes a pixel)."""
    stride = 3 * width
    if width < 1 or height < 1 or len(rgb) != stride * height:
        raise ValueError(f"need {stride * height} RGB bytes for {width}x{height}, got {len(rgb)}")
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))  # filter 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


class Canvas:
    """An RGB pixel buffer; drawing outside it is clipped."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.rgb = bytearray(bytes(background) * (width * height))

    def put(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.rgb[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), both included."""
        left, right = max(0, min(x0, x1)), min(self.width - 1, max(x0, x1))
        if left > right:
            return
        row = bytes(color) * (right - left + 1)
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            start = 3 * (y * self.width + left)
            self.rgb[start : start + len(row)] = row

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham's line, `width` pixels thick (a square brush)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x0, y0, x0 + width - 1, y0 + width - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 2) -> None:
        """Draw `s` with its top-left corner at (x, y); unknown characters are blanks."""
        for k, ch in enumerate(s.upper()):
            rows = FONT.get(ch, (0,) * GLYPH_H)
            left = x + k * (GLYPH_W + 1) * scale
            for r, bits in enumerate(rows):
                for c in range(GLYPH_W):
                    if bits & (4 >> c):
                        self.rect(
                            left + c * scale, y + r * scale, left + (c + 1) * scale - 1, y + (r + 1) * scale - 1, color
                        )

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.rgb)


def text_width(s: str, scale: int = 2) -> int:
    return max(0, len(s) * (GLYPH_W + 1) * scale - scale)


def nice_ticks(lo: float, hi: float, max_ticks: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, max_ticks - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks = []
    k = 0
    while not ticks or ticks[-1] < hi - 1e-9 * step:
        ticks.append(round(first + k * step, 12))
        k += 1
    return ticks


def tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    return f"{value:.{decimals}f}"


@dataclass
class _Box:
    left: int
    top: int
    right: int
    bottom: int

    def x(self, value: float, lo: float, hi: float) -> int:
        return round(self.left + (value - lo) / (hi - lo) * (self.right - self.left))

    def y(self, value: float, lo: float, hi: float) -> int:
        return round(self.bottom - (value - lo) / (hi - lo) * (self.bottom - self.top))


def _axes(canvas: Canvas, box: _Box, x_ticks: list[float], y_ticks: list[float], grid: bool = True) -> None:
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    for v in y_ticks:
        y = box.y(v, y_ticks[0], y_ticks[-1])
        if grid:
            canvas.line(box.left + 1, y, box.right, y, LIGHT_GREY)
        canvas.line(box.left - 5, y, box.left, y, BLACK)
        label = tick_label(v, y_step)
        canvas.text(box.left - 8 - text_width(label), y - GLYPH_H, label)
    for v in x_ticks:
        x = box.x(v, x_ticks[0], x_ticks[-1])
        canvas.line(x, box.bottom, x, box.bottom + 5, BLACK)
        label = tick_label(v, x_step)
        canvas.text(x - text_width(label) // 2, box.bottom + 9, label)
    canvas.line(box.left, box.top, box.left, box.bottom, BLACK)
    canvas.line(box.left, box.bottom, box.right, box.bottom, BLACK)


def _draw_cdf(canvas: Canvas, box: _Box, panel: CdfPanel) -> None:
    values = [v for vs in panel.series.values() for v in vs]
    x_ticks = nice_ticks(0.0, max(values) if values else 1.0)
    y_ticks = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    _axes(canvas, box, x_ticks, y_ticks)
    lo, hi = x_ticks[0], x_ticks[-1]
    for k, (label, series) in enumerate(panel.series.items()):
        color = PALETTE[k % len(PALETTE)]
        points = sorted(series)
        prev = (box.x(points[0], lo, hi), box.bottom) if points else None
        for i, v in enumerate(points):  # a step function: right to the value, then up
            x, y = box.x(v, lo, hi), box.y((i + 1) / len(points), 0.0, 1.0)
            canvas.line(prev[0], prev[1], x, prev[1], color, 2)
            canvas.line(x, prev[1], x, y, color, 2)
            prev = (x, y)
        legend_y = box.bottom - 20 - 14 * (len(panel.series) - 1 - k)
        canvas.rect(box.right - 110, legend_y, box.right - 100, legend_y + 9, color)
        canvas.text(box.right - 94, legend_y, f"{label} ({len(points)})")


def _draw_bars(canvas: Canvas, box: _Box, panel: BarPanel) -> None:
    top = max((v for _, v in panel.bars), default=0.0)
    y_ticks = nice_ticks(0.0, top if top > 0 else 1.0)
    _axes(canvas, box, [], y_ticks, grid=True)
    n = len(panel.bars)
    if n == 0:
        return
    slot = (box.right - box.left) / n
    labelled = slot >= max(text_width(label) for label, _ in panel.bars) + 4
    for i, (label, value) in enumerate(panel.bars):
        color = panel.colors[i] if i < len(panel.colors) else PALETTE[0]
        x0 = round(box.left + i * slot + slot * 0.15) + 1
        x1 = max(x0, round(box.left + (i + 1) * slot - slot * 0.15))
        canvas.rect(x0, box.y(value, y_ticks[0], y_ticks[-1]), x1, box.bottom - 1, color)
        if labelled:
            canvas.text((x0 + x1) // 2 - text_width(label) // 2, box.bottom + 9, label)


def plot_png(panels: list[Panel], panel_width: int = 420, height: int = 360) -> bytes:
    """Panels side by side, each with its title above and its axes inside; PNG bytes."""
    canvas = Canvas(panel_width * len(panels), height)
    for k, panel in enumerate(panels):
        left = k * panel_width
        canvas.text(left + 70, 10, panel.title)
        box = _Box(left + 70, 36, left + panel_width - 20, height - 40)
        if isinstance(panel, CdfPanel):
            _draw_cdf(canvas, box, panel)
        else:
            _draw_bars(canvas, box, panel)
    return canvas.png()
