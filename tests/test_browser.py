"""The demo's report.html and the docs site in a real browser: headless Chromium.

The report is checked in light and dark; every page of the site (built here with
``mkdocs build --strict``) must fit a 1280 px wide window and load nothing from the
network. Skipped where Chromium is not installed (Debian: ``apt-get install chromium``).
``.ci/run`` installs it in the background while the tests start and sets
``PIPEMARK_CHROMIUM_WAIT``: these tests then wait that many seconds at most for it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import html
import io
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from pipemark import _demo
from tests._docs import build_site


def _find_chromium() -> str | None:
    return next(
        (shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None
    )


# Seconds to wait for Chromium being installed in the background (.ci/run), 0: none.
WAIT_S = float(os.environ.get("PIPEMARK_CHROMIUM_WAIT", "0"))
INSTALLED = _find_chromium() is not None or WAIT_S > 0
# CI installs Chromium (.ci/run), so there a missing browser is a failure, not a skip.
if not INSTALLED and os.environ.get("CI") == "true":
    raise RuntimeError("CI=true but Chromium is not installed: .ci/run installs it.")
pytestmark = pytest.mark.skipif(not INSTALLED, reason="Chromium is not installed")


@pytest.fixture(scope="module")
def chromium() -> str:
    """Chromium's path, once installed (waiting ``PIPEMARK_CHROMIUM_WAIT`` s at most)."""
    deadline = time.monotonic() + WAIT_S
    found = _find_chromium()
    while found is None and time.monotonic() < deadline:
        time.sleep(2)
        found = _find_chromium()
    if found is None:
        pytest.fail(f"Chromium was not installed within {WAIT_S:g} s (PIPEMARK_CHROMIUM_WAIT).")
    return found


SMALL = {"num_layers": 4, "vocab": 32, "d_model": 16, "num_heads": 2, "seq": 8, "batch": 2}
WIDTH, HEIGHT = 1280, 1600


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("demo")
    assert _demo.run(io.StringIO(), out_dir, model=SMALL)
    return out_dir / "report.html"


def _screenshot(chromium, page, png, profile, *, dark: bool) -> np.ndarray:
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
    subprocess.run([chromium, *flags, page.as_uri()], capture_output=True, timeout=120, check=True)
    pixels = image.imread(str(png))[..., :3]
    assert pixels.shape == (HEIGHT, WIDTH, 3)
    return pixels.mean(axis=2)  # luminance, 0 (black) to 1 (white)


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_report_renders_in_chromium(chromium, report, tmp_path, dark):
    png = tmp_path / "shot.png"
    gray = _screenshot(chromium, report, png, tmp_path / "profile", dark=dark)
    background = gray[5, 5]
    if dark:
        assert background < 0.2
    else:
        assert background > 0.9
    # The heading is drawn in a colour that contrasts with the background.
    heading = gray[20:60, 30:600]
    assert np.abs(heading - background).max() > 0.6
    # The plot sits below the heading: its figure is transparent, so the page's
    # background shows through (mostly), under bars and text drawn in contrast to it.
    plot = np.abs(gray[150:500, 40:1200] - background)
    assert (plot < 0.05).mean() > 0.5 and (plot > 0.3).mean() > 0.05
    # The page has content well down the screen: the stage table and the stage blocks.
    rows_with_ink = np.abs(gray - background).max(axis=1) > 0.3
    assert rows_with_ink[600:1000].mean() > 0.2


# ----------------------------------------------------------------- the docs site

ROOT = Path(__file__).resolve().parent.parent
SITE_WIDTH, SITE_HEIGHT = 1280, 900
RESULT_ID = "pipemark-layout-probe"

# Run in each page once it has loaded (and the theme's scripts have run): how wide the
# page is against the window, which elements stick out of it (only those outside any
# box that scrolls or clips: inside one, wide content is fine), whether the iframes'
# own pages fit them, and which resources came from the network.
PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  function describe(el) {
    var name = el.tagName.toLowerCase();
    if (el.id) name += "#" + el.id;
    if (el.classList.length) name += "." + Array.from(el.classList).join(".");
    return name;
  }
  function clipped(el) {
    for (var p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      if (getComputedStyle(p).overflowX !== "visible") return true;
    }
    return false;
  }
  function measure(doc) {
    var root = doc.documentElement, limit = root.clientWidth, culprits = [];
    doc.querySelectorAll("body *").forEach(function (el) {
      var right = el.getBoundingClientRect().right;
      if (right > limit + 1 && culprits.length < 5 && !clipped(el)) {
        culprits.push(describe(el) + " ends at " + Math.round(right) + " px");
      }
    });
    return {scrollWidth: root.scrollWidth, clientWidth: limit, culprits: culprits};
  }
  var result = measure(document);
  result.frames = Array.from(document.querySelectorAll("iframe")).map(function (frame) {
    try { return measure(frame.contentDocument); } catch (error) { return String(error); }
  });
  result.network = performance.getEntriesByType("resource").map(function (entry) {
    return entry.name;
  }).filter(function (url) { return /^https?:/i.test(url); });
  var out = document.createElement("pre");
  out.id = "RESULT_ID";
  out.textContent = JSON.stringify(result);
  document.body.appendChild(out);
}, 200); });
</script>""".replace("RESULT_ID", RESULT_ID)

# A <script src> or <link href> (stylesheet, icon, preload) on another host: the page
# would need the network.
EXTERNAL = re.compile(
    r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", re.I
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    return build_site(tmp_path_factory.mktemp("site"))


def _pages(site_dir: Path) -> list[Path]:
    # 404.html links its styles from the server root, so it only renders when served.
    return sorted(p for p in site_dir.rglob("*.html") if p.name != "404.html")


def _layout(chromium: str, page: Path, profile: Path) -> dict:
    """Load ``page`` (with the probe added) in headless Chromium at the site width."""
    text = page.read_text(encoding="utf-8")
    page.write_text(text.replace("</body>", PROBE + "</body>", 1), encoding="utf-8")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        # The embedded report is another file:// page; let the probe look inside it.
        "--allow-file-access-from-files",
        # Nothing may come from the network: send any request to a closed port.
        "--proxy-server=127.0.0.1:9",
        f"--user-data-dir={profile}",
        f"--window-size={SITE_WIDTH},{SITE_HEIGHT}",
        "--virtual-time-budget=5000",
        "--dump-dom",
    ]
    run = subprocess.run([chromium, *flags, page.as_uri()], capture_output=True, timeout=120)
    match = re.search(rf'<pre id="{RESULT_ID}">(.*?)</pre>', run.stdout.decode("utf-8"), re.S)
    assert match, f"{page}: the probe did not report (Chromium: {run.stderr[-500:]!r})"
    return json.loads(html.unescape(match.group(1)))


def test_site_fits_1280_px_and_works_offline(chromium, site, tmp_path):
    pages = _pages(site)
    assert len(pages) > 10 and (site / "api" / "index.html") in pages
    problems = []
    for page in site.rglob("*.html"):
        for tag in EXTERNAL.findall(page.read_text(encoding="utf-8")):
            problems.append(f"{page.relative_to(site)} loads from the network: {tag}")
    # Chromium is single-threaded enough per page that a few run side by side well,
    # even on two cores.
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        profiles = [tmp_path / f"profile{k}" for k in range(len(pages))]
        layouts = list(pool.map(functools.partial(_layout, chromium), pages, profiles))
    for page, layout in zip(pages, layouts):
        name = page.relative_to(site)
        if layout["scrollWidth"] > layout["clientWidth"]:
            problems.append(
                f"{name} is {layout['scrollWidth']} px wide in a {layout['clientWidth']} px "
                f"window: {', '.join(layout['culprits']) or 'no single element'}"
            )
        for k, frame in enumerate(layout["frames"]):
            if isinstance(frame, str) or frame["scrollWidth"] > frame["clientWidth"]:
                problems.append(f"{name}: iframe {k} is cut off or unreadable: {frame}")
        if layout["network"]:
            problems.append(f"{name} fetched {layout['network']}")
    assert not problems, "\n".join(problems)
