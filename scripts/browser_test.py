"""Run every chapter in a real browser: JupyterLab headless, Chromium driven by Playwright.

For each ``chapters/*.ipynb`` (copies in a temporary folder, outputs stripped, so the committed notebooks
are never touched): open it in JupyterLab, run all cells, wait until every code cell has run and the
kernel is idle, fail on any error output (a traceback; warnings and progress bars on stderr are fine),
and save a screenshot of the whole notebook to ``artifacts/browser/<chapter>.png``. In the chapters
listed in ``SLIDERS`` a widget slider is moved with the keyboard and the figure under it must change
(``<chapter>-slider-before.png`` / ``-after.png``). Prints a per-chapter summary and exits non-zero on
any failure.

    python scripts/browser_test.py                 # every chapter
    python scripts/browser_test.py 03 04_batching  # chapters whose name starts with these

Needs ``pip install -e ".[browser]"`` (Playwright) and a Chromium (``apt-get install chromium``);
Playwright's own browser download is not used: ``--chromium`` (default ``$CHROMIUM`` or
``/usr/bin/chromium``) is launched instead. ``make browser-test`` installs both when missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
ARTIFACTS = ROOT / "artifacts" / "browser"
TRACEBACK = "Traceback (most recent call last)"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
VIEWPORT = {"width": 1400, "height": 1000}
SLICE_HEIGHT = 4000  # full-notebook screenshots are taken in slices this tall and stitched
MAX_SHOT_HEIGHT = 60000  # longer notebooks are cut here (pixels at full width)


@dataclass(frozen=True)
class Slider:
    """A widget slider to move in a chapter: the cell that holds it, its label, and the key to press."""

    cell_marker: str  # a piece of the code cell's source that identifies the cell
    label: str  # the slider's description
    key: str  # ArrowRight / ArrowLeft: towards a value that exists from the slider's initial one


SLIDERS: dict[str, Slider] = {
    # block-table stepper: starts at step 0
    "03_kv_cache": Slider("block_pool_stepper(", "step", "ArrowRight"),
    # scheduler explorer: the token budget starts at its largest setting
    "04_batching": Slider("scheduler_explorer(", "max_num_batched_tokens", "ArrowLeft"),
    # layer-wise K/V transfer: the prompt starts at 4096 tokens
    "05_pd_disaggregation": Slider("layerwise_explorer(", "prompt tokens", "ArrowRight"),
    # cluster explorer: 60 requests/s to start with; one more simulates both placements again
    "05b_cluster_simulation": Slider("cluster_explorer(", "requests/s", "ArrowRight"),
    # quality explorer: a press at a budget of 64 tokens; each move measures again and adds a bar
    "06_kv_compression": Slider("quality_explorer(", "budget", "ArrowRight"),
    # recorded routing: top-2 to start with
    "07_moe": Slider("routing_explorer(", "top-k", "ArrowRight"),
    # deployment guide: the request rate starts at 4 req/s; more requests in flight grow the KV bar
    "08_serving": Slider("def show_advice", "requests/s", "ArrowRight"),
}


# ----------------------------------------------------------------------------------------- pure parts


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def list_chapters(chapters_dir: Path = CHAPTERS) -> list[Path]:
    """Every notebook in ``chapters_dir``, in name order; names that start with ``.`` or ``_`` (checkpoints,
    scratch copies) are not chapters."""
    return sorted(p for p in chapters_dir.glob("*.ipynb") if not p.name.startswith((".", "_")))


def select_chapters(chapters: Sequence[Path], wanted: Sequence[str]) -> list[Path]:
    """The chapters whose stem equals or starts with one of ``wanted`` (all of them when empty).

    Raises ValueError naming any entry of ``wanted`` that matches no chapter.
    """
    if not wanted:
        return list(chapters)
    stems = [w.removesuffix(".ipynb").rsplit("/", 1)[-1] for w in wanted]
    missing = [w for w in stems if not any(p.stem.startswith(w) for p in chapters)]
    if missing:
        raise ValueError(f"no chapter matches {', '.join(missing)}; chapters: {', '.join(p.stem for p in chapters)}")
    return [p for p in chapters if any(p.stem == w or p.stem.startswith(w) for w in stems)]


def strip_outputs(nb: dict[str, Any]) -> dict[str, Any]:
    """A copy of a notebook with no outputs, execution counts or saved widget state.

    The browser test runs the stripped copy, so every output it sees was made in this run.
    """
    nb = json.loads(json.dumps(nb))
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    return nb


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def is_error_output(output: dict[str, Any]) -> bool:
    """Whether one nbformat output means a cell failed.

    An ``error`` output always does; a stderr stream only when it holds a Python traceback (warnings,
    logging and tqdm's progress bars also write to stderr and are not failures).
    """
    kind = output.get("output_type")
    if kind == "error":
        return True
    if kind == "stream" and output.get("name") == "stderr":
        return TRACEBACK in _text(output.get("text"))
    return False


def is_error_text(text: str) -> bool:
    """Whether text rendered as stderr in the page (widget outputs included) is a traceback."""
    return TRACEBACK in ANSI.sub("", text)


def describe_error(output: dict[str, Any], limit: int = 4000) -> str:
    """A readable, ANSI-free account of an error output (the traceback's last ``limit`` characters)."""
    if output.get("output_type") == "error":
        text = "\n".join(output.get("traceback") or []) or f"{output.get('ename')}: {output.get('evalue')}"
    else:
        text = _text(output.get("text"))
    text = ANSI.sub("", text).strip()
    return text if len(text) <= limit else "…" + text[-limit:]


def child_pids(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every descendant of ``pid`` (Linux ``/proc``; empty elsewhere), children before grandchildren."""
    parents: dict[int, list[int]] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = parents.get(todo.pop(0), [])
        out.extend(kids)
        todo.extend(kids)
    return out


@dataclass
class Result:
    chapter: str
    seconds: float = 0.0
    ok: bool = False
    cells: str = ""
    detail: list[str] = field(default_factory=list)
    screenshots: list[str] = field(default_factory=list)


def summary_lines(results: Iterable[Result], total: float) -> list[str]:
    """The table printed at the end: one line per chapter, then the total."""
    results = list(results)
    width = max([len(r.chapter) for r in results] + [7])
    lines = [f"{'chapter':<{width}}  {'seconds':>7}  result  cells run   notes"]
    for r in results:
        note = r.detail[0].splitlines()[0] if r.detail else ""
        lines.append(f"{r.chapter:<{width}}  {r.seconds:7.1f}  {'PASS' if r.ok else 'FAIL':<6}  {r.cells:<9}  {note}")
    failed = sum(not r.ok for r in results)
    lines.append(f"{'total':<{width}}  {total:7.1f}  {'PASS' if results and not failed else 'FAIL'}"
                 f"    {len(results) - failed}/{len(results)} chapters passed")
    return lines


# --------------------------------------------------------------------------------------- JupyterLab

SETTINGS = {
    # Render every cell (no virtual scrolling), so outputs can be checked and screenshotted.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin.jupyterlab-settings": {"enabled": False},
}


class Lab:
    """JupyterLab from this interpreter, headless on 127.0.0.1, serving ``workdir`` with a token."""

    def __init__(self, workdir: Path, log: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        home = workdir / ".jupyter-home"
        for name, values in SETTINGS.items():
            path = home / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ)
        env.update(
            JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"),
            JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM=env.get("TOKENIZERS_PARALLELISM",
                                                                                          "false"),
            PYTHONUNBUFFERED="1",
        )
        env.pop("JUPYTER_TOKEN", None)
        cmd = [
            sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={workdir}", "--LabApp.expose_app_in_browser=True",
            f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
            "--ServerApp.shutdown_no_activity_timeout=0",
        ]
        if hasattr(os, "getuid") and os.getuid() == 0:
            cmd.append("--allow-root")
        self.log_file = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def api(self, method: str, path: str, timeout: float = 10) -> Any:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}; see {self.log_file.name}")
            with contextlib.suppress(OSError, ValueError):
                self.api("GET", "/api/status", timeout=2)
                return
            time.sleep(0.5)
        raise TimeoutError(f"JupyterLab did not answer on {self.url} within {timeout:.0f} s")

    def shutdown_kernels(self) -> None:
        """Shut down every session's kernel (a chapter's kernel and whatever processes it started)."""
        with contextlib.suppress(OSError, ValueError):
            for session in self.api("GET", "/api/sessions") or []:
                with contextlib.suppress(OSError, ValueError):
                    self.api("DELETE", f"/api/sessions/{session['id']}", timeout=30)

    def stop(self) -> None:
        """Stop the server, its kernels and anything they started; never leaves a process behind."""
        if self.proc.poll() is None:
            self.shutdown_kernels()
            # Kernels run in sessions of their own: note every descendant before the server goes.
            pids = child_pids(self.proc.pid)
            with contextlib.suppress(OSError, ValueError):
                self.api("POST", "/api/shutdown", timeout=5)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self.log_file.close()


# ------------------------------------------------------------------------------------------- browser

# Everything below runs in the page through window.jupyterapp (LabApp.expose_app_in_browser).
JS_NOTEBOOK = """() => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  if (!w || !w.content || !w.sessionContext || !w.content.model) return null;
  return {ready: w.context.isReady, kernel: w.sessionContext.session && w.sessionContext.session.kernel
          ? w.sessionContext.session.kernel.status : null, path: w.context.path};
}"""

JS_RUN_ALL = """async () => {
  const app = window.jupyterapp;
  app.shell.collapseLeft();
  app.shell.collapseRight();
  window.__runAll = undefined;
  app.commands.execute('notebook:run-all-cells').then(ok => { window.__runAll = ok === false ? 'failed' : 'ok'; },
                                                       err => { window.__runAll = 'rejected: ' + err; });
  return true;
}"""

JS_PROGRESS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  const cells = w.content.model.cells;
  let code = 0, ran = 0, running = 0;
  const errors = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code' || !c.sharedModel.getSource().trim()) continue;
    code++;
    if (c.executionCount !== null && c.executionCount !== undefined) ran++;
    if (c.executionState === 'running') running++;
    const outs = c.outputs.toJSON();
    for (const o of outs) {
      if (o.output_type === 'error' || (o.output_type === 'stream' && o.name === 'stderr'))
        errors.push({cell: i, output: o});
    }
  }
  const stderr = Array.from(document.querySelectorAll(
      '.jp-NotebookPanel:not(.lm-mod-hidden) [data-mime-type="application/vnd.jupyter.stderr"]'))
    .map(e => e.innerText);
  return {kernel: kernel ? kernel.status : null, code, ran, running, errors, stderr, runAll: window.__runAll};
}"""

JS_SCROLLER = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const el = panel && (panel.querySelector('.jp-WindowedPanel-outer') || panel.querySelector('.jp-Notebook'));
  return el ? {height: el.scrollHeight, view: el.clientHeight} : null;
}"""

JS_SCROLL_TO = """(y) => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const el = panel.querySelector('.jp-WindowedPanel-outer') || panel.querySelector('.jp-Notebook');
  el.scrollTop = y;
  return el.scrollTop;
}"""


class ChapterFailure(Exception):
    pass


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Call ``check`` until it returns something truthy; TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def screenshot_notebook(page: Any, path: Path) -> None:
    """The whole notebook as one PNG: the scrolling panel shot slice by slice and stitched (Pillow)."""
    from PIL import Image, ImageOps

    box = page.evaluate(JS_SCROLLER)
    if not box:
        page.screenshot(path=str(path), full_page=True)
        return
    height = min(box["height"], MAX_SHOT_HEIGHT)
    page.set_viewport_size({"width": VIEWPORT["width"], "height": SLICE_HEIGHT})
    try:
        page.wait_for_timeout(300)
        box = page.evaluate(JS_SCROLLER)
        view = box["view"]
        panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer").first
        if not panel.count():
            panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first
        slices = []
        y = 0
        while y < height:
            top = page.evaluate(JS_SCROLL_TO, y)
            page.wait_for_timeout(150)
            shot = path.with_suffix(f".part{len(slices)}.png")
            panel.screenshot(path=str(shot))
            slices.append((top, shot))
            y += view
        images = [(top, Image.open(shot)) for top, shot in slices]
        width = max(im.width for _, im in images)
        scale = images[0][1].height / view if view else 1.0
        canvas = Image.new("RGB", (width, int(height * scale)), "white")
        for top, im in images:
            canvas.paste(im, (0, int(top * scale)))
        # JupyterLab pads the end of a notebook so it can scroll past it: drop the blank tail.
        inked = ImageOps.invert(canvas.convert("L")).getbbox()
        if inked and inked[3] + 24 < canvas.height:
            canvas = canvas.crop((0, 0, canvas.width, inked[3] + 24))
        canvas.save(path, optimize=True)
        for _, shot in slices:
            shot.unlink(missing_ok=True)
        page.evaluate(JS_SCROLL_TO, 0)
    finally:
        page.set_viewport_size(VIEWPORT)


def run_all(page: Any, result: Result, timeout: float) -> None:
    page.evaluate(JS_RUN_ALL)
    deadline = time.monotonic() + timeout
    idle_since = None
    last = None
    while True:
        p = page.evaluate(JS_PROGRESS)
        last = p
        result.cells = f"{p['ran']}/{p['code']}"
        errors = [e for e in p["errors"] if is_error_output(e["output"])]
        dom_errors = [t for t in p["stderr"] if is_error_text(t)]
        idle = p["kernel"] == "idle" and not p["running"]
        if (errors or dom_errors) and idle:
            for e in errors:
                result.detail.append(f"error in cell {e['cell']}:\n{describe_error(e['output'])}")
            if not errors:
                result.detail.extend(f"traceback on the page:\n{t[-4000:]}" for t in dom_errors)
            raise ChapterFailure("error output")
        if p["runAll"] is not None and idle and p["ran"] == p["code"]:
            # idle twice in a row, half a second apart: nothing is queued behind the last cell
            if idle_since is not None:
                break
            idle_since = time.monotonic()
        else:
            idle_since = None
        if p["kernel"] in ("dead", "unknown") or (p["runAll"] or "").startswith("rejected"):
            raise ChapterFailure(f"kernel {p['kernel']}, run-all {p['runAll']}")
        if time.monotonic() > deadline:
            raise ChapterFailure(f"timed out after {timeout:.0f} s: {p['ran']}/{p['code']} cells run, "
                                 f"kernel {p['kernel']}")
        time.sleep(0.5)
    if last["runAll"] != "ok":
        raise ChapterFailure(f"run-all reported {last['runAll']} with no error output")


def move_slider(page: Any, name: str, slider: Slider, out: Path, result: Result, timeout: float) -> None:
    """Press an arrow key on the slider's handle and require the figure under it to change."""
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").filter(
        has=page.locator(".cm-content", has_text=slider.cell_marker)).first
    if not cell.count():
        raise ChapterFailure(f"no code cell containing {slider.cell_marker!r}")
    row = cell.locator(".widget-slider").filter(
        has=page.locator(".widget-label", has_text=re.compile(rf"^\s*{re.escape(slider.label)}\s*$"))).first
    handle = row.locator(".noUi-handle").first
    img = cell.locator(".widget-output img, .jupyter-widgets-output-area img").first
    try:
        handle.wait_for(state="visible", timeout=timeout * 1000)
        img.wait_for(state="visible", timeout=timeout * 1000)
    except Exception as e:
        raise ChapterFailure(f"slider {slider.label!r} or its figure never appeared: {e}") from e
    cell.scroll_into_view_if_needed()
    before_src = img.get_attribute("src") or ""
    readout = row.locator(".widget-readout").first

    def value() -> str | None:
        with contextlib.suppress(Exception):
            return readout.inner_text(timeout=2000).strip()
        return handle.get_attribute("aria-valuenow")

    before_value = value()
    shot = out / f"{name}-slider-before.png"
    cell.screenshot(path=str(shot))
    result.screenshots.append(shot.name)
    handle.focus()
    handle.press(slider.key)

    def changed():
        p = page.evaluate(JS_PROGRESS)
        if p["kernel"] != "idle":
            return None
        now = cell.locator(".widget-output img, .jupyter-widgets-output-area img").first
        if not now.count():
            return None
        src = now.get_attribute("src") or ""
        return src if src and src != before_src else None

    try:
        wait_for(changed, timeout, f"the figure under {slider.label!r} to change")
    except TimeoutError as e:
        raise ChapterFailure(str(e)) from e
    page.wait_for_timeout(300)
    after_value = value()
    shot = out / f"{name}-slider-after.png"
    cell.screenshot(path=str(shot))
    result.screenshots.append(shot.name)
    errors = [t for t in page.evaluate(JS_PROGRESS)["stderr"] if is_error_text(t)]
    if errors:
        result.detail.append("traceback after moving the slider:\n" + errors[0][-4000:])
        raise ChapterFailure("error after moving the slider")
    result.detail.append(f"slider {slider.label!r} {before_value} -> {after_value} ({slider.key}): figure changed")


def run_chapter(context: Any, lab: Lab, rel: str, out: Path, timeout: float) -> Result:
    name = Path(rel).stem
    result = Result(name)
    start = time.monotonic()
    page = context.new_page()
    console = out / f"{name}-console.log"
    messages: list[str] = []
    page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: messages.append(f"pageerror: {e}"))
    try:
        page.goto(f"{lab.url}/lab/tree/{rel}?reset", wait_until="domcontentloaded", timeout=60_000)
        try:
            wait_for(lambda: (lambda s: s and s["ready"] and s["kernel"] == "idle")(page.evaluate(JS_NOTEBOOK)),
                     min(120.0, timeout), "the notebook to open with an idle kernel")
        except TimeoutError as e:
            raise ChapterFailure(str(e)) from e
        run_all(page, result, timeout - (time.monotonic() - start))
        if name in SLIDERS:
            move_slider(page, name, SLIDERS[name], out, result, timeout=60)
        result.ok = True
    except ChapterFailure as e:
        result.detail.insert(0, str(e))
    except Exception as e:  # a Playwright error, a closed page: this chapter fails, the next one runs
        result.detail.insert(0, f"{type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(Exception):
            shot = out / f"{name}.png"
            screenshot_notebook(page, shot)
            result.screenshots.insert(0, shot.name)
        with contextlib.suppress(Exception):
            page.close()
        lab.shutdown_kernels()
        console.write_text("\n".join(messages) + "\n")
        result.seconds = time.monotonic() - start
    return result


@contextlib.contextmanager
def workspace(chapters: Sequence[Path]) -> Iterator[Path]:
    """A temporary copy of the chapters (outputs stripped) beside links to the repository's assets."""
    with tempfile.TemporaryDirectory(prefix="minipd-browser-") as tmp:
        work = Path(tmp)
        (work / "chapters").mkdir()
        for nb in chapters:
            (work / "chapters" / nb.name).write_text(json.dumps(strip_outputs(json.loads(nb.read_text()))))
        for extra in ("assets",):
            if (ROOT / extra).exists():
                (work / extra).symlink_to(ROOT / extra)
        yield work


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter names or prefixes (default: every chapter)")
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("BROWSER_TEST_TIMEOUT", 240)),
                        help="seconds per chapter (default 240, or $BROWSER_TEST_TIMEOUT)")
    parser.add_argument("--total-timeout", type=float,
                        default=float(os.environ.get("BROWSER_TEST_TOTAL_TIMEOUT", 1500)),
                        help="seconds for the whole run before it is stopped (default 1500)")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
                        help="the Chromium to drive (default $CHROMIUM or /usr/bin/chromium)")
    parser.add_argument("--out", type=Path, default=ARTIFACTS, help="where screenshots go (artifacts/browser)")
    parser.add_argument("--headed", action="store_true", help="show the browser (needs a display)")
    parser.add_argument("--chapters-dir", type=Path, default=CHAPTERS, help=argparse.SUPPRESS)  # tests the harness
    args = parser.parse_args(argv)

    try:
        chapters = select_chapters(list_chapters(args.chapters_dir), args.chapters)
    except ValueError as e:
        parser.error(str(e))
    if not chapters:
        parser.error(f"no notebooks in {args.chapters_dir}")
    if not Path(args.chromium).exists():
        print(f"browser-test: no Chromium at {args.chromium}; install it (Debian: apt-get install -y chromium) "
              "or pass --chromium PATH", file=sys.stderr)
        return 2
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print('browser-test: Playwright is missing; pip install -e ".[browser]"', file=sys.stderr)
        return 2

    args.out.mkdir(parents=True, exist_ok=True)
    for old in [*args.out.glob("*.png"), *args.out.glob("*.log"), *args.out.glob("*.json")]:
        old.unlink()

    def out_of_time(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"the browser test ran past --total-timeout={args.total_timeout:.0f} s")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.total_timeout))
    start = time.monotonic()
    results: list[Result] = []
    lab = None
    try:
        with workspace(chapters) as work:
            lab = Lab(work, args.out / "jupyterlab.log")
            print(f"browser-test: JupyterLab on {lab.url} serving {work}", flush=True)
            lab.wait_ready(120)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium, headless=not args.headed,
                                             args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
                try:
                    context = browser.new_context(viewport=VIEWPORT)
                    # the token once, as a cookie for every later page
                    page = context.new_page()
                    page.goto(f"{lab.url}/lab?token={lab.token}", wait_until="domcontentloaded", timeout=60_000)
                    page.close()
                    for nb in chapters:
                        remaining = args.total_timeout - (time.monotonic() - start) - 30
                        if remaining < 30:
                            results.append(Result(nb.stem, detail=["not run: out of total time"]))
                            continue
                        print(f"browser-test: {nb.stem} ...", flush=True)
                        r = run_chapter(context, lab, f"chapters/{nb.name}", args.out, min(args.timeout, remaining))
                        results.append(r)
                        print(f"browser-test: {nb.stem} {'PASS' if r.ok else 'FAIL'} in {r.seconds:.1f} s"
                              + "".join(f"\n    {line}" for d in r.detail for line in d.splitlines()), flush=True)
                finally:
                    browser.close()
    except Exception as e:
        results.append(Result("(harness)", detail=[f"{type(e).__name__}: {e}"]))
    finally:
        signal.alarm(0)
        if lab is not None:
            lab.stop()
    total = time.monotonic() - start
    print("\n" + "\n".join(summary_lines(results, total)))
    (args.out / "summary.json").write_text(json.dumps(
        {"total_seconds": round(total, 1), "chapters": [r.__dict__ | {"seconds": round(r.seconds, 1)}
                                                        for r in results]}, indent=1))
    print(f"screenshots in {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
