"""The demo's report.html in a real browser: headless Chromium, light and dark.

Skipped where Chromium is not installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import io
import shutil
import subprocess

import numpy as np
import pytest

from pipemark import _demo

CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None
)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed")

SMALL = {"num_layers": 4, "vocab": 32, "d_model": 16, "num_heads": 2, "seq": 8, "batch": 2}
WIDTH, HEIGHT = 1280, 1600


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("demo")
    assert _demo.run(io.StringIO(), out_dir, model=SMALL)
    return out_dir / "report.html"


def _screenshot(page, png, profile, *, dark: bool) -> np.ndarray:
    image = pytest.importorskip("matplotlib.image")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--screenshot={png}",
        f"--window-size={WIDTH},{HEIGHT}",
    ]
    if dark:
        # Both ask for prefers-color-scheme: dark; older and newer builds honour one each.
        flags += ["--force-dark-mode", "--blink-settings=preferredColorScheme=0"]
    subprocess.run([CHROMIUM, *flags, page.as_uri()], capture_output=True, timeout=120, check=True)
    pixels = image.imread(str(png))[..., :3]
    assert pixels.shape == (HEIGHT, WIDTH, 3)
    return pixels.mean(axis=2)  # luminance, 0 (black) to 1 (white)


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_report_renders_in_chromium(report, tmp_path, dark):
    png = tmp_path / "shot.png"
    gray = _screenshot(report, png, tmp_path / "profile", dark=dark)
    background = gray[5, 5]
    if dark:
        assert background < 0.2
    else:
        assert background > 0.9
    # The heading is drawn in a colour that contrasts with the background.
    heading = gray[20:60, 30:600]
    assert np.abs(heading - background).max() > 0.6
    # The plot (a white card in both schemes) sits below the heading.
    assert (gray[150:500, 40:1200] > 0.95).mean() > 0.5
    # The page has content well down the screen: the stage table and the stage blocks.
    rows_with_ink = np.abs(gray - background).max(axis=1) > 0.3
    assert rows_with_ink[600:1000].mean() > 0.2
