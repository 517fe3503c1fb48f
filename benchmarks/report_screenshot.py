"""Render `attnslim report DIR`'s HTML in headless Chromium and check the screenshot is a page, not a blank.

    .venv/bin/python benchmarks/report_screenshot.py out/demo      # after `make demo`; writes out/demo/report.png

Needs Debian's chromium (`apt-get install chromium`); the network stays closed (background networking off).
Checks: Chromium exits 0, the PNG has the requested width, and the page is not blank — enough non-white pixels,
and the charts' blue bars are present. Prints the numbers it checked.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

from attnslim.report import write_report

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BAR_BLUE = (0x4A, 0x7A, 0xB5)  # attnslim.report.svg's bar colour


def read_png_rgb(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + n
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    channels = {2: 3, 6: 4}[header[9]]
    raw, stride, rows, prev = zlib.decompress(idat), width * channels, [], bytearray(width * channels)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):  # PNG filters: none, sub, up, average, paeth
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            p = a + b - c
            pred = [0, a, b, (a + b) // 2, a if abs(p - a) <= min(abs(p - b), abs(p - c)) else
                    (b if abs(p - b) <= abs(p - c) else c)][f]
            line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line[j] for i in range(0, stride, channels) for j in range(i, i + 3)))
        prev = line
    return width, height, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", help="a compressed model directory (e.g. out/demo after `make demo`)")
    ap.add_argument("--width", type=int, default=1000)
    ap.add_argument("--height", type=int, default=2400)
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("chromium not found: install Debian's chromium (apt-get install chromium)", file=sys.stderr)
        return 2
    html, _ = write_report(args.directory)
    png = Path(args.directory) / "report.png"
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={args.width},{args.height}",
               f"--screenshot={png.resolve()}", html.resolve().as_uri()]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    width, height, rows = read_png_rgb(png)
    pixels = [row[i:i + 3] for row in rows for i in range(0, len(row), 3)]
    ink = sum(1 for p in pixels if min(p) < 200) / len(pixels)
    blue = sum(1 for p in pixels if all(abs(p[k] - BAR_BLUE[k]) < 12 for k in range(3))) / len(pixels)
    ok = width == args.width and ink > 0.01 and blue > 0.001
    print(f"{png}: {width}x{height}, non-white {ink:.2%}, chart blue {blue:.2%} -> {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
